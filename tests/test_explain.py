"""A parity failure says where (the first failure's prompt, position, both sides' top tokens, the re-run command) and,
with --explain, why: faults planted in one layer of the engine are named by that layer and the half they are in."""

from __future__ import annotations

import re

import pytest

from harness import golden as G
from harness.__main__ import main
from harness.parity.explain import explain, format_explanation
from harness.parity.failure import headline
from harness.parity.layer_faults import FAULTS, planted_in_layer
from harness.parity.paths import PATHS
from harness.parity.run import run_parity

LAYER = 2  # of 4; in tiny-qwen3-moe a mixture-of-experts layer (its layer 0 is dense)
CASES = [(model, fault) for model in ("tiny-qwen3", "tiny-qwen3-moe") for fault in FAULTS]
# sandwich norms: the attention's contribution is normed before it is added, and the MLP's norm has another name
GEMMA_CASES = [("tiny-gemma3", "attention-scaled"), ("tiny-gemma3", "mlp-norm-unweighted")]
BATCH = next(p for p in PATHS if p.name == "batch")


def _explain(model: str, device: str, dtype: str, prompt: int = 3, step: int = 3, golden_dtype: str | None = None):
    """--explain's comparison on one golden prompt, up to its decode step `step` (prefill, then decode steps); the
    prompt's tokens from the golden in golden_dtype (default: dtype)."""
    gs = G.load_checked(model, device, golden_dtype or dtype)
    return explain(model, device, dtype, gs, BATCH, prompt, len(gs.prompts[prompt].prompt_ids) - 1 + step)


@pytest.mark.parametrize("model,fault", CASES + GEMMA_CASES)
def test_explain_names_the_planted_layer_and_half(model, fault):
    layer = 1 if model == "tiny-gemma3" else LAYER
    with planted_in_layer(fault, layer):
        e = _explain(model, "cpu", "float32")
    assert e.first is not None and (e.first.layer, e.first.half) == (layer, FAULTS[fault][1]), format_explanation(e)


def test_explain_names_no_layer_of_a_correct_engine():
    e = _explain("tiny-qwen3-moe", "cpu", "float32")
    assert e.first is None, format_explanation(e)


def test_explain_in_bf16_on_the_cpu_names_the_layer_under_the_rounding_of_the_layers_before_it():
    """In bf16 the stream of every layer after the first carries more rounding error than a RoPE base off by 100x
    adds to it; each layer alone shows it (the MoE model's router near ties make it the harder case)."""
    e = _explain("tiny-qwen3-moe", "cpu", "bfloat16", golden_dtype="float32")  # the CPU has fp32 goldens only
    assert e.first is None, format_explanation(e)
    with planted_in_layer("rope-base", LAYER):
        e = _explain("tiny-qwen3-moe", "cpu", "bfloat16", golden_dtype="float32")
    assert e.first is not None and (e.first.layer, e.first.half) == (LAYER, "attention"), format_explanation(e)


def test_a_failure_says_where_and_why(capsys):
    with planted_in_layer("mlp-norm-unweighted", 1):
        status = main(["parity", "--model", "tiny-qwen3", "--path", "batch", "--prompt", "1", "--no-report",
                       "--explain"])
    out = capsys.readouterr().out
    assert status == 1
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("first failure:"))
    assert first == 0, out  # the failure comes first
    assert re.fullmatch(r"first failure: model tiny-qwen3, dtype float32, path batch, prompt 1, position \d+ "
                        r"\((prefill|decode step \d+)\)", lines[0]), lines[0]
    block = "\n".join(lines[:10])
    assert re.search(r"golden top-5: ('.*' -?[\d.e-]+  ){4}'.*' -?[\d.e-]+\n", block), block
    assert re.search(r"engine top-5: ('.*' -?[\d.e-]+  ){4}'.*' -?[\d.e-]+\n", block), block
    assert re.search(r"failed: largest logprob err [\d.e-]+ .* vs tol [\d.e-]+", block), block
    assert ("re-run this path, judging only this prompt (run in the same company): python -m harness parity --model "
            "tiny-qwen3 --device cpu --dtype float32 --path batch --prompt 1") in block
    assert "build/parity/tiny-qwen3/cpu-float32/golden.obtained.npz" in block
    assert lines[-1] == "first diverging layer: 1 (mlp)", out


def test_prompt_runs_one_golden_prompt_by_index_or_name(capsys):
    gs = G.load_checked("tiny-qwen3", "cpu", "float32")
    name = gs.prompts[2].name
    for chosen in ("2", name):
        result = run_parity("tiny-qwen3", paths=["batch"], prompt=chosen)
        assert result.passed and [(p.prompt, p.index) for p in result.prompts] == [(name, 2)]
        assert headline(result) is None
    capsys.readouterr()
    assert main(["parity", "--model", "tiny-qwen3", "--path", "batch", "--prompt", "no-such-prompt"]) == 2
    assert capsys.readouterr().err.startswith("error: --prompt no-such-prompt: ")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model,fault", CASES)
def test_explain_names_the_planted_layer_on_the_gpu(model, fault, dtype):
    with planted_in_layer(fault, LAYER):
        e = _explain(model, "cuda", dtype)
    assert e.first is not None and (e.first.layer, e.first.half) == (LAYER, FAULTS[fault][1]), format_explanation(e)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "smollm2-135m"])
def test_explain_names_no_layer_of_a_correct_engine_on_the_gpu(model, dtype):
    e = _explain(model, "cuda", dtype)
    assert e.first is None, format_explanation(e)
