"""The CUDA path on a GPU: FlashInfer attention against the torch reference, CUDA graphs against eager decode,
the dummy request's writes, and the memory plan. Skipped without CUDA; run on the device, results committed."""

from __future__ import annotations

from typing import List

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.driver import Driver

pytestmark = pytest.mark.cuda
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [42] * 9, list(range(7, 300, 3))]


_LIVE: List[Engine] = []


@pytest.fixture(autouse=True)
def _shutdown_engines():
    """A failing test still shuts its engine down, so the next test can start one."""
    yield
    while _LIVE:
        eng = _LIVE.pop()
        if eng.model is not None:
            eng.shutdown()


def make(model: str = "tiny-qwen3", **kw) -> Engine:
    kw.setdefault("num_page_override", 4096)
    kw.setdefault("max_seq_len_override", 1024)
    kw.setdefault("dtype", torch.bfloat16)
    eng = Engine(EngineConfig(model_path=str(zoo.path(model)), tp_info=DistributedInfo(0, 1), device="cuda", **kw))
    _LIVE.append(eng)
    return eng


def logprobs(engine: Engine, prompts: List[List[int]], steps: int = 8, **kw) -> dict:
    seen = {}

    def hook(uid: int, pos: int, lp: torch.Tensor) -> None:
        for i in range(lp.shape[0]):
            seen[(uid, pos + i)] = lp[i].float().cpu()

    forced = [[(7 * i + 3 * j) % 1000 + 10 for j in range(steps)] for i in range(len(prompts))]
    Driver(engine, **kw).generate(prompts, SamplingParams(max_tokens=steps), forced=forced, on_logits=hook)
    return seen


def max_diff(ref: dict, got: dict, k: int = 64) -> float:
    """Max |logprob| difference on the reference's top-k ids at every position (parity's measure)."""
    assert ref.keys() == got.keys()
    return max((ref[p].gather(0, ids) - got[p].gather(0, ids)).abs().max().item()
               for p in ref for ids in [ref[p].topk(k).indices])


def bf16_tolerance(model: str) -> float:
    """The parity tolerance of the model's bf16 GPU golden: 4 x HF's own sdpa-vs-eager spread in bf16."""
    from harness.golden import load_checked
    from harness.parity import tolerance

    return tolerance(load_checked(model, "cuda", "bfloat16"), "bfloat16")


def hf_logprobs(model: str, prompts: List[List[int]], forced: List[List[int]], attn: str) -> dict:
    """HF bf16 on the GPU over each whole sequence (prompt + forced tokens), keyed like logprobs()."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(zoo.path(model), dtype=torch.bfloat16, attn_implementation=attn).cuda()
    out = {}
    with torch.inference_mode():
        for uid, (p, f) in enumerate(zip(prompts, forced)):
            lp = torch.log_softmax(hf(torch.tensor([p + f[:-1]], device="cuda")).logits[0].float(), -1).cpu()
            out.update({(uid, pos): lp[pos] for pos in range(lp.shape[0])})
    return out


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny-qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_both_backends_match_hf_within_its_own_spread(model, page_size):
    """Each attention backend against HF bf16 on the same sequences, with the tolerance parity uses:
    4 x HF's own spread (sdpa vs eager attention) measured here, on these very sequences."""
    forced = [[(7 * i + 3 * j) % 1000 + 10 for j in range(8)] for i in range(len(PROMPTS))]
    ref, eager = hf_logprobs(model, PROMPTS, forced, "sdpa"), hf_logprobs(model, PROMPTS, forced, "eager")
    tol = 4 * max_diff(ref, eager)
    for backend in ("flashinfer", "torch"):
        eng = make(model, page_size=page_size, attention_backend=backend, cuda_graph_max_bs=0)
        assert eng.config.attention_backend == backend
        got = logprobs(eng, PROMPTS)
        eng.shutdown()
        err = max_diff(ref, got)
        print(f"{model} page_size {page_size} {backend}: max |engine - HF| logprob {err:.3g}, tol {tol:.3g}")
        assert err <= tol


@pytest.mark.parametrize("bs", [3, 5, 17, 40])
def test_graph_replay_equals_eager(bs):
    """Batch sizes between captured ones (padded with the dummy request) and above the largest (eager fallback)."""
    prompts = [PROMPTS[i % len(PROMPTS)][: 5 + i] for i in range(bs)]
    eager = make(cuda_graph_max_bs=0, max_running_req=64)
    ref = logprobs(eager, prompts)
    eager.shutdown()
    graphed = make(cuda_graph_bs=[1, 2, 4, 8, 16, 32], max_running_req=64)
    assert graphed.graph_runner.max_graph_bs == 32
    got = logprobs(graphed, prompts)
    graphed.shutdown()
    diff = max_diff(ref, got)
    print(f"bs {bs}: max |graph - eager| logprob {diff:.3g}")
    # the same kernels, but the padded batch may get another split-KV plan: within the bf16 parity tolerance
    assert diff <= bf16_tolerance("tiny-qwen3")


def test_dummy_request_writes_only_the_dummy_page():
    eng = make(cuda_graph_bs=[4], max_running_req=8, page_size=4)
    driver = Driver(eng)
    dummy = eng.num_pages
    eng.kv_cache._kv[:, :, dummy] = 0  # graph capture already wrote the dummy's values there: clear them
    before = eng.kv_cache._kv.clone()
    res = driver.generate(PROMPTS[:3], SamplingParams(max_tokens=4))  # decode bs 3 replays the bs-4 graph
    assert all(len(r.output_ids) == 4 for r in res)
    changed = (eng.kv_cache._kv != before).flatten(3).any(-1).any(0).any(0)  # [num_pages + 1]: page touched
    pages = changed.nonzero().flatten().tolist()
    assert dummy in pages  # the padding row wrote somewhere: the dummy page
    # every other changed page belonged to a real request (3 requests, <= 3 x ceil((37 + 4) / 4) pages)
    assert len(pages) - 1 <= 3 * 11
    eng.shutdown()


def test_memory_plan_leaves_room_for_the_largest_forward():
    eng = make(num_page_override=None, max_seq_len_override=None, max_prefill_tokens=8192, max_running_req=256,
               model="tiny-qwen3")
    plan = eng.plan
    assert plan.reserve > 0 and plan.capped_by == "memory_ratio"
    # the largest prefill and the largest decode batch run without running out of memory
    assert eng.config.max_forward_len == 4096  # tiny-qwen3's max_position_embeddings
    driver = Driver(eng, max_prefill_tokens=8192)
    driver.generate([list(range(1, 4095))], SamplingParams(max_tokens=2))
    driver.generate([[1, 2, 3]] * 256, SamplingParams(max_tokens=3))
    eng.shutdown()


def test_fp32_on_cuda_uses_the_torch_backend():
    eng = make(dtype=torch.float32)
    assert eng.config.attention_backend == "torch" and not eng.graph_runner.graphs
    eng.shutdown()
