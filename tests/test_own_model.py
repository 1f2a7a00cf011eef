"""A model the project does not ship, brought as a user brings one: a folder made here from a seed (tiny random
weights of several architectures, SmolLM2's tokenizer with or without its chat template), then golden and parity
through the command line. What cannot run is refused in one line with exit status 2; a planted fault fails with 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import golden as G
from harness import prompts as P
from harness import zoo
from harness.__main__ import main
from harness.models import from_folder

SEED = 7
COMMON = dict(vocab_size=49152, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# what a user may bring: GQA ratios, head dims (explicit or hidden / heads), biases, tied and untied heads, MoE
ARCHS: Dict[str, tuple] = {
    "llama-gqa5": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=80, num_attention_heads=10, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
        tie_word_embeddings=True)),
    "qwen2-bias-untied": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=None, tie_word_embeddings=False)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4, hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=True)),
}
PROMPTS = [{"prompt": "The capital of France is", "max_new_tokens": 6},
           {"prompt": "def fibonacci(n):", "max_new_tokens": 4, "name": "code"}]


def make_model(folder: Path, arch: str | tuple = "qwen3", seed: int = SEED, chat_template: bool = True,
               weights: bool = True, tokenizer: bool = True) -> Path:
    """A tiny random model of ARCHS[arch] (or of arch = (model class, config class, config fields)) saved as
    save_pretrained saves it, with SmolLM2's tokenizer files."""
    import transformers

    model_cls, config_cls, extra = ARCHS[arch] if isinstance(arch, str) else arch
    config = getattr(transformers, config_cls)(**{**COMMON, **extra}, architectures=[model_cls])
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    if weights:
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json") + (("chat_template.jinja",) if chat_template else ()):
            shutil.copy(zoo.TOKENIZER_ASSET / name, folder / name)
    return folder


def prompts_file(tmp: Path, prompts: Any = PROMPTS, lines: bool = True) -> Path:
    f = tmp / ("prompts.jsonl" if lines else "prompts.json")
    f.write_text("\n".join(json.dumps(p) for p in prompts) + "\n" if lines else json.dumps(prompts))
    return f


def refused(capsys: pytest.CaptureFixture, argv: list, *needles: str) -> None:
    """The command ends in exit status 2 and one line `error: ...` holding every needle."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("arch", list(ARCHS))
def test_golden_then_parity_on_a_folder_of_ones_own(tmp_path, arch):
    folder = make_model(tmp_path / f"my-{arch}", arch)
    goldens, pfile = tmp_path / "goldens", prompts_file(tmp_path)
    assert main(["golden", "--model-path", str(folder), "--golden-dir", str(goldens), "--prompts", str(pfile)]) == 0
    gs = G.load(goldens / f"my-{arch}" / "cpu-float32")
    assert [len(p.tokens) for p in gs.prompts] == [6, 4]
    assert gs.provenance["weights_sha256"] == zoo.weights_sha256(folder)
    assert gs.provenance["prompt_set"] == P.read_file(pfile).prompts
    pfile.unlink()  # parity runs the prompts the golden recorded
    assert main(["parity", "--model-path", str(folder), "--golden-dir", str(goldens), "--path", "batch",
                 "--no-sampling", "--no-report"]) == 0


def test_every_path_on_an_untied_model_without_chat_template(tmp_path):
    folder = make_model(tmp_path / "m", "qwen2-bias-untied", chat_template=False)
    goldens = tmp_path / "g"
    pfile = prompts_file(tmp_path, ["Once upon a time", "1, 2, 3, 5, 8,"], lines=False)
    assert main(["golden", "--model-path", str(folder), "--name", "mine", "--golden-dir", str(goldens),
                 "--prompts", str(pfile)]) == 0
    assert (goldens / "mine" / "cpu-float32" / "golden.npz").is_file()
    assert main(["parity", "--model-path", str(folder), "--name", "mine", "--golden-dir", str(goldens),
                 "--no-sampling", "--no-report"]) == 0
    assert main(["golden", "--check", "--model-path", str(folder), "--name", "mine", "--golden-dir", str(goldens)]) == 0


DENSE = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config"}


@st.composite
def dense_shapes(draw: st.DrawFn) -> tuple:
    """A dense architecture with its GQA group, KV heads, head dim (not hidden / heads), tied head and depth."""
    kv = draw(st.integers(1, 2))
    return (draw(st.sampled_from(sorted(DENSE))), dict(
        num_key_value_heads=kv, num_attention_heads=kv * draw(st.integers(1, 5)),
        head_dim=draw(st.sampled_from([8, 32])),
        hidden_size=draw(st.sampled_from([32, 48])), tie_word_embeddings=draw(st.booleans()),
        num_hidden_layers=draw(st.integers(1, 2)), rope_theta=draw(st.sampled_from([1e4, 5e5]))))


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=dense_shapes())
def test_any_drawn_dense_shape_passes_golden_then_parity(tmp_path_factory, shape):
    arch, extra = shape
    tmp = tmp_path_factory.mktemp("drawn")
    folder = make_model(tmp / "drawn", (arch, DENSE[arch], extra))
    pfile = prompts_file(tmp, [{"prompt": "Water boils at", "max_new_tokens": 3}])
    assert main(["golden", "--model-path", str(folder), "--golden-dir", str(tmp), "--prompts", str(pfile)]) == 0
    assert main(["parity", "--model-path", str(folder), "--golden-dir", str(tmp), "--path", "batch", "--no-sampling",
                 "--no-report"]) == 0, shape


@pytest.fixture
def own_golden(tmp_path):
    """A Llama folder and its golden on two prompts."""
    folder = make_model(tmp_path / "llama", "llama-gqa5")
    goldens = tmp_path / "g"
    assert main(["golden", "--model-path", str(folder), "--golden-dir", str(goldens),
                 "--prompts", str(prompts_file(tmp_path))]) == 0
    return folder, goldens


def test_a_weight_the_engine_reads_perturbed_fails_parity(own_golden, monkeypatch, capsys):
    import engine.models.weights as W

    folder, goldens = own_golden
    clean = W._iter_safetensors

    def perturbed(path):  # one projection 2% off, as a loader bug would make it
        for name, t in clean(path):
            yield name, t * 1.02 if name == "model.layers.1.self_attn.o_proj.weight" else t

    monkeypatch.setattr(W, "_iter_safetensors", perturbed)
    assert main(["parity", "--model-path", str(folder), "--golden-dir", str(goldens), "--path", "batch",
                 "--no-sampling", "--no-report"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_golden_made_from_other_weights_is_refused(own_golden, tmp_path, capsys):
    _, goldens = own_golden
    other = make_model(tmp_path / "other", "llama-gqa5", seed=SEED + 1)
    refused(capsys, ["parity", "--model-path", str(other), "--name", "llama", "--golden-dir", str(goldens),
                     "--no-sampling", "--no-report"],
            "weights_sha256", f"golden --model-path {other} --name llama --device cpu")


def test_a_golden_made_from_other_prompts_is_refused(own_golden, tmp_path, capsys):
    folder, goldens = own_golden
    (tmp_path / "other").mkdir()
    other = prompts_file(tmp_path / "other", ["Another prompt"])
    refused(capsys, ["parity", "--model-path", str(folder), "--golden-dir", str(goldens), "--prompts", str(other),
                     "--no-sampling", "--no-report"], "prompt_set_sha256", f"--prompts {other}")


def test_a_missing_golden_says_how_to_make_it(tmp_path, capsys):
    folder = make_model(tmp_path / "m", "qwen3")
    goldens = tmp_path / "g"
    refused(capsys, ["parity", "--model-path", str(folder), "--golden-dir", str(goldens), "--no-sampling"],
            f"python -m harness golden --model-path {folder} --device cpu --dtype float32 --golden-dir {goldens}")


@pytest.mark.parametrize("verb", ["golden", "parity"])
def test_an_unsupported_architecture_is_refused(tmp_path, capsys, verb):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152)).save_pretrained(folder)
    shutil.copy(zoo.TOKENIZER_ASSET / "tokenizer.json", folder / "tokenizer.json")
    refused(capsys, [verb, "--model-path", str(folder), "--golden-dir", str(tmp_path / "g")],
            "GPT2LMHeadModel", "supported: ", "LlamaForCausalLM")


@pytest.mark.parametrize("lacks", ["weights", "tokenizer", "config"])
def test_an_incomplete_folder_is_refused(tmp_path, capsys, lacks):
    folder = make_model(tmp_path / "m", "qwen3", weights=lacks != "weights", tokenizer=lacks != "tokenizer")
    if lacks == "config":
        (folder / "config.json").unlink()
    refused(capsys, ["golden", "--model-path", str(folder), "--golden-dir", str(tmp_path / "g")],
            {"weights": "has no weights", "tokenizer": "has no tokenizer", "config": "has no config.json"}[lacks])


def test_a_config_only_zoo_model_is_refused_in_one_line(capsys):
    refused(capsys, ["golden", "--model", "qwen3-0.6b"], "has no weights")


@pytest.mark.parametrize("content, needle", [
    ("[]", "holds no prompt"),
    ('{"prompt": "a"}\n{"prompt": ', "line 2 is not JSON"),
    ('[{"prompt": "a", "max_new_tokens": 0}]', "max_new_tokens 0"),
    ('[{"prompt": "a", "text": "b"}]', "unknown keys ['text']"),
    ('["a", ""]', "prompt 1 is not a non-empty string"),
    ('[{"prompt": "a", "name": "x"}, {"prompt": "b", "name": "x"}]', "two prompts are named 'x'"),
])
def test_a_bad_prompts_file_is_refused(tmp_path, capsys, content, needle):
    folder = make_model(tmp_path / "m", "qwen3")
    (tmp_path / "p.json").write_text(content)
    refused(capsys, ["golden", "--model-path", str(folder), "--golden-dir", str(tmp_path / "g"),
                     "--prompts", str(tmp_path / "p.json")], needle)


def test_the_default_set_follows_the_tokenizer_and_the_config(tmp_path):
    """The chat prompt when the tokenizer has a chat template, the long prompts when the model has a sliding window;
    the zoo's models get the sets their committed goldens were made from."""
    shared = json.loads(P.PROMPTS_FILE.read_text())["prompts"]
    long = json.loads(P.LONG_PROMPTS_FILE.read_text())["prompts"]
    plain = [p for p in shared if "chat" not in p]
    cases = [("qwen3", True, shared), ("qwen3", False, plain), ("gemma3", True, shared + long),
             ("gemma3", False, plain + long)]
    for arch, chat, want in cases:
        folder = make_model(tmp_path / f"{arch}-{chat}", arch, chat_template=chat, weights=False)
        assert P.default_set(from_folder(folder)).prompts == want, (arch, chat)
    for name in ("tiny-qwen3", "tiny-gemma3", "tiny-qwen3-moe"):
        prov = json.loads((G.golden_dir(name, "cpu", "float32") / "provenance.json").read_text())
        assert G.expected_identity(name, "cpu", "float32") == {k: prov[k] for k in G.IDENTITY_KEYS}


def test_the_weights_digest_is_cached_until_a_file_changes(tmp_path, monkeypatch):
    folder = make_model(tmp_path / "m", "qwen3")
    monkeypatch.setenv("ENGINE_ZOO_DIR", str(tmp_path / "zoo"))
    first = zoo.cached_weights_sha256(folder)
    assert first == zoo.weights_sha256(folder)
    monkeypatch.setattr(zoo, "weights_sha256", lambda f: "hashed again")
    assert zoo.cached_weights_sha256(folder) == first
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())  # a new mtime
    assert zoo.cached_weights_sha256(folder) == "hashed again"


def test_fuzz_runs_a_folder_of_ones_own_against_its_golden(own_golden, capsys):
    folder, goldens = own_golden
    assert main(["fuzz", "--model-path", str(folder), "--golden-dir", str(goldens), "--budget", "3"]) == 0
    assert "fuzz llama on cpu: PASS" in capsys.readouterr().out


def test_sampling_draws_on_the_real_logits_of_a_folder(tmp_path):
    from harness.sampling.cases import real_cases
    from harness.sampling.run import run_grid

    cases = real_cases(from_folder(make_model(tmp_path / "m", "qwen3")))
    assert [c.name for c in cases] == ["real-temperature", "real-filters"] and cases[0].vocab == 49152
    assert run_grid("cpu", cases=cases, max_cost=100 * 49152).passed


def test_bench_takes_a_folder_without_weights_on_dummy_weights(tmp_path, monkeypatch):
    from harness.bench import run

    class Measured(BaseException):  # not an Exception: main() reports those as internal errors, exit 3
        """What the bench would measure, seen: no need to measure it."""

    def capture(device, models, with_hf):
        raise Measured(models)

    monkeypatch.setattr(run, "run_bench", capture)
    folder = make_model(tmp_path / "m", "mixtral", weights=False, tokenizer=False)
    with pytest.raises(Measured) as measured:
        main(["bench", "--model-path", str(folder), "--model", "tiny-qwen3", "--no-hf"])
    seen = measured.value.args[0]
    assert [(m.name, m.has_weights, m.folder) for m in seen] == [
        ("tiny-qwen3", True, zoo.path("tiny-qwen3")), ("m", False, folder.resolve())]
