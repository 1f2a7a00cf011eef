"""Errors a user can cause are clear exceptions naming the problem."""

from __future__ import annotations

import json

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.driver import Driver


def config(path, **kw) -> EngineConfig:
    kw.setdefault("num_page_override", 256)
    return EngineConfig(model_path=str(path), tp_info=DistributedInfo(0, 1), dtype=torch.float32, device="cpu",
                        max_seq_len_override=64, **kw)


@pytest.fixture
def engine(request: pytest.FixtureRequest):
    """tiny-qwen3 on the CPU; a test's `engine_kw` mark overrides config fields."""
    mark = request.node.get_closest_marker("engine_kw")
    eng = Engine(config(zoo.path("tiny-qwen3"), **(mark.kwargs if mark else {})))
    yield eng
    eng.shutdown()


def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at"):
        Engine(config(tmp_path / "nowhere"))


def test_unsupported_architecture(tmp_path):
    cfg = json.loads((zoo.path("tiny-qwen3") / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: Gemma3ForCausalLM, "
                       "Llama"):
        Engine(config(tmp_path))


@pytest.mark.parametrize("pages", [0, 1])
def test_kv_pool_of_one_page_or_less(pages):
    with pytest.raises(ValueError, match="not enough memory for the KV cache"):
        Engine(config(zoo.path("tiny-qwen3"), num_page_override=pages))


def test_prompt_longer_than_max_seq_len(engine):
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        Driver(engine).generate([[1] * 65], SamplingParams(max_tokens=1))


def test_prompt_plus_max_tokens_over_max_seq_len(engine):
    with pytest.raises(ValueError, match="max_tokens 10 exceeds max_seq_len"):
        Driver(engine).generate([[1] * 60], SamplingParams(max_tokens=10))


def test_empty_prompt(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        Driver(engine).generate([[]], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("bad", [-1, 49152, 2 ** 31])  # 2 ** 31: no int32 holds it
def test_token_id_outside_vocabulary(engine, bad):
    with pytest.raises(ValueError, match=rf"token ids \[{bad}\] are outside the vocabulary \[0, 49152\)"):
        Driver(engine).generate([[1, bad, 2]], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-0.5), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_p=0.0), "top_p must lie in"),
    (dict(top_p=1.5), "top_p must lie in"),
    (dict(top_k=0), "top_k must be -1"),
    (dict(top_k=-2), "top_k must be -1"),
    (dict(min_p=1.5), "min_p must lie in"),
    (dict(max_tokens=0), "max_tokens must be"),
])
def test_invalid_sampling_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_tp_size_that_does_not_divide_heads():
    cfg = EngineConfig(model_path=str(zoo.path("smollm2-135m")), tp_info=DistributedInfo(0, 2), dtype=torch.float32)
    with pytest.raises(ValueError, match="9 is not divisible by TP size 2"):
        Engine(cfg)


def test_invalid_engine_config():
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        config(zoo.path("tiny-qwen3"), page_size=0)


@pytest.mark.engine_kw(num_page_override=8)
def test_request_larger_than_the_pool(engine):
    with pytest.raises(ValueError, match="exceeds max_seq_len 8 .* the KV pool's 8 tokens"):
        Driver(engine).generate([[1] * 10], SamplingParams(max_tokens=10))


# ------------------------------------------------------------------------------------------------ MoE
def _moe_copy(tmp_path, weights: bool = False, **changes):
    """tiny-qwen3-moe's config.json (and its weights when asked) in tmp_path; a change of None drops the field."""
    import shutil

    src = zoo.path("tiny-qwen3-moe")
    cfg = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if weights:
        shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("field, named", [("num_local_experts", "num_experts / num_local_experts"),
                                          ("num_experts_per_tok", "num_experts_per_tok"),
                                          ("moe_intermediate_size", "moe_intermediate_size"),
                                          ("norm_topk_prob", "norm_topk_prob")])
def test_moe_config_missing_a_field(tmp_path, field, named):
    with pytest.raises(ValueError, match=f"Qwen3MoeForCausalLM config.json lacks {named}: a mixture-of-experts model "
                                         "must state it"):
        Engine(config(_moe_copy(tmp_path, **{field: None})))


def test_moe_more_experts_per_token_than_experts(tmp_path):
    with pytest.raises(ValueError, match=r"num_experts_per_tok 9 must lie in \[1, num_experts 8\]"):
        Engine(config(_moe_copy(tmp_path, num_experts_per_tok=9)))


def test_tp_size_that_does_not_divide_the_experts(tmp_path):
    """Checked before any rendezvous, like the heads: 4 heads and 512 dense rows divide by 4, 126 expert rows do not."""
    cfg = EngineConfig(model_path=str(_moe_copy(tmp_path, moe_intermediate_size=126)), tp_info=DistributedInfo(0, 4),
                       dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"moe_intermediate_size 126 \(each of the 8 experts' intermediate dimension, "
                                         r"which TP splits\) is not divisible by TP size 4"):
        Engine(cfg)


def test_checkpoint_missing_an_expert(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _moe_copy(tmp_path, weights=True)
    state = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in state.items() if ".layers.2.mlp.experts.5." not in k}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks expert 5 of layer 2 \(model\.layers\.2\.mlp\.experts\.5\.gate_proj / "
                                         r"up_proj\.weight; 1 of 8 experts missing there\)"):
        Engine(config(folder))


@pytest.mark.parametrize("backend, message", [("fast", "unknown MoE backend 'fast'; choose one of: auto, torch, fused"),
                                              ("fused", "the fused MoE backend cannot run here: it needs a CUDA "
                                                        "device, got cpu; use moe_backend='torch'")])
def test_bad_moe_backend(backend, message):
    with pytest.raises(ValueError, match=message):
        Engine(config(zoo.path("tiny-qwen3-moe"), moe_backend=backend))


def test_a_second_engine_is_refused_and_the_live_one_keeps_working(engine):
    """Starting an engine while one is live fails with a clear error, and the failed start's cleanup leaves the live
    engine's process-wide state (global context, stream, TP groups) alone: it still generates the same tokens."""
    from engine.core import get_global_ctx

    prompt = [[1, 2, 3, 4]]
    before = Driver(engine).generate(prompt, SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="already live"):
        Engine(config(zoo.path("tiny-qwen3")))
    assert get_global_ctx() is engine.ctx
    assert Driver(engine).generate(prompt, SamplingParams(max_tokens=4)) == before
