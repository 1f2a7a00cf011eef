"""The engine gives the same bits in every process: the same batched work, in several fresh processes, over model
shapes the zoo does not have (architecture, depth, width, GQA, head size, RoPE scaling, biases, weight scale) and
prompts well past 256 and 1024 tokens in drawn batch compositions (page size, prefill budget, cached prefixes), every
position's log-probabilities and every token bitwise the same in each (harness.fuzz.processes). A process lays out
its memory anew: a kernel chosen by an address, an allocation or a one-time choice shows here and nowhere else. The
planted fault is such a kernel (a projection's rows past 256 summed in another order by its input's address): the
check must catch it. `nox -s determinism` runs the search longer (DETERMINISM_EXAMPLES, default 40 there)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Dict

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core import SamplingParams
from harness.fuzz.processes import first_difference, run_in_processes
from harness.fuzz.runs import RunSpec
from harness.models import from_folder
from harness.parity.run import run_parity
from seeded_models import seeded_folder

EXAMPLES = int(os.environ.get("DETERMINISM_EXAMPLES", "3"))
PROCESSES = 3
LENGTHS = [(1, 64), (257, 700), (1025, 1300)]  # short, past 256, past 1024


@st.composite
def drawn_models(draw: st.DrawFn) -> Dict[str, Any]:
    arch = draw(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]))
    kv = draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 4))
    config = dict(num_key_value_heads=kv, num_attention_heads=heads, head_dim=draw(st.sampled_from([32, 64, 128])),
                  hidden_size=heads * draw(st.sampled_from([16, 32, 64])), num_hidden_layers=draw(st.integers(1, 3)),
                  intermediate_size=draw(st.sampled_from([128, 256, 512])), tie_word_embeddings=draw(st.booleans()),
                  rope_theta=draw(st.sampled_from([1e4, 5e5, 1e6])), max_position_embeddings=16384,
                  initializer_range=draw(st.sampled_from([0.05, 0.2, 1.0])))
    scaling = draw(st.sampled_from([None, "linear", "llama3"] if arch == "LlamaForCausalLM" else [None, "linear"]))
    if scaling == "linear":
        config["rope_scaling"] = dict(rope_type="linear", factor=draw(st.sampled_from([2.0, 4.0])))
    elif scaling == "llama3":
        config["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192)
    if arch == "LlamaForCausalLM":
        config.update(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    return dict(arch=arch, seed=draw(st.integers(0, 2 ** 16)), config=config)


@st.composite
def batches(draw: st.DrawFn) -> Dict[str, Any]:
    """1-4 prompts, at least one past 256 tokens; pages of 1 or 16; every prompt in one step, or a budget that cuts the
    long ones into chunks while the others decode; cached prefixes."""
    spans = draw(st.lists(st.sampled_from(LENGTHS), min_size=1, max_size=4))
    if all(span == LENGTHS[0] for span in spans):
        spans[0] = LENGTHS[1]
    rng = random.Random(draw(st.integers(0, 2 ** 16)))
    prompts = [[rng.randrange(10, 49142) for _ in range(draw(st.integers(*span)))] for span in spans]
    prefix = [draw(st.sampled_from([0, len(p) // 2])) for p in prompts]
    return dict(prompts=prompts, prefix_lens=prefix, page_size=draw(st.sampled_from([1, 16])),
                budget=draw(st.sampled_from([4096, 512, 300])), new=draw(st.integers(1, 4)))


def _check(folder: Path, batch: Dict[str, Any], plant: str | None = None) -> Any:
    model = from_folder(folder)
    longest = max(len(p) for p in batch["prompts"]) + batch["new"]
    kwargs = dict(dtype=torch.float32, device="cpu", page_size=batch["page_size"], max_running_req=4,
                  num_page_override=4 * 2048 // batch["page_size"], max_seq_len_override=-(-longest // 256) * 256)
    spec = RunSpec("process", batch["prompts"], [SamplingParams(max_tokens=batch["new"], ignore_eos=True)] *
                   len(batch["prompts"]), [], overlap=True, max_prefill_tokens=batch["budget"],
                   prefix_lens=batch["prefix_lens"], check_pool=False)
    return first_difference(run_in_processes(model, kwargs, spec, PROCESSES, plant=plant))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(drawn=drawn_models(), batch=batches())
def test_the_same_batched_work_gives_the_same_bits_in_every_process(tmp_path_factory, drawn, batch):
    folder = seeded_folder(tmp_path_factory.mktemp("m") / "m", drawn["arch"], drawn["seed"], **drawn["config"])
    failure = _check(folder, batch)
    assert failure is None, (drawn, [len(p) for p in batch["prompts"]], batch["page_size"], batch["budget"], failure)


def test_a_kernel_chosen_by_address_is_caught(tmp_path):
    """The planted fault (harness.fuzz.faults: gemm-path-by-address) in each process: the bits past row 256 follow
    where the allocator put the activations, which differs between processes."""
    folder = seeded_folder(tmp_path / "m", "LlamaForCausalLM", 3, num_key_value_heads=2, num_attention_heads=4,
                           head_dim=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 49142) for _ in range(n)] for n in (40, 600)]
    failure = _check(folder, dict(prompts=prompts, prefix_lens=[0, 0], page_size=1, budget=4096, new=2),
                     plant="gemm-path-by-address")
    assert failure is not None and failure.invariant == "process", failure
    assert _check(folder, dict(prompts=prompts, prefix_lens=[0, 0], page_size=1, budget=4096, new=2)) is None


def test_a_parity_failure_of_an_engine_whose_bits_follow_the_process_says_so():
    """An engine whose projections past row 256 follow a factor drawn once per process (tests/peer_faults.py:
    DrawnPerProcess) fails the batch path in every process; the failing path, run again in a fresh process, gives other
    bits, and the failure block says the engine is not deterministic there instead of offering a re-run that may
    pass."""
    result = run_parity("tiny-qwen3", "cpu", "float32", ["batch"], engine="python:peer_faults:DrawnPerProcess",
                        rerun_failure=True)
    assert not result.passed
    assert result.nondeterministic.startswith("not deterministic: this path run again in a fresh process"), \
        result.failure
    assert result.nondeterministic in result.failure and "its bits may differ once more" in result.failure
    assert "judging only this prompt (run in the same company)" not in result.failure
