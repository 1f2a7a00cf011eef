"""The resolution search's parts: each planted fault changes what the engine or the sampler computes when on and
nothing (bitwise) when off or of size 0; the bisection finds a known threshold; a real parity probe sees a 1%
decode softmax-scale error on tiny-qwen3; the command writes its report where the others do."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from engine.sample import Sampler
from harness import report, zoo
from harness.__main__ import main
from harness.driver import Driver
from harness.resolution.adapters import ComponentCheck, FuzzCheck
from harness.resolution.checks import ParityCheck
from harness.resolution.faults import FAMILIES, Family, lost_writes
from harness.resolution.search import Verdict, find_threshold
from harness.sampling.cases import L12, SP
from harness.sampling.run import make_batch

PROMPTS = [[504, 3575, 282, 4649, 314, 1183, 28, 9], [1060, 314, 253, 1345, 30]]
ENGINE_FAULTS = {"softmax-decode": 0.05, "softmax-prefill": 0.05, "rope-base": 0.05, "kv-wrong-slot": 0.3}
SAMPLER_FAULTS = {"temperature": 0.5, "top-p": 0.3, "sampler-softmax": 0.5}


def _logprobs(engine: Engine) -> Dict[Tuple[int, int], torch.Tensor]:
    """(uid, position) -> log-probabilities at every prefill and decode position of a short greedy run."""
    for layer in range(engine.config.model_config.num_layers):  # a fresh pool, as every probe has
        engine.kv_cache.k_cache(layer).zero_()
        engine.kv_cache.v_cache(layer).zero_()
    out: Dict[Tuple[int, int], torch.Tensor] = {}

    def keep(uid: int, start: int, lp: torch.Tensor) -> None:
        for i in range(lp.shape[0]):
            out[(uid, start + i)] = lp[i].clone()

    Driver(engine).generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True), on_logits=keep)
    return out


def _same(a: Dict, b: Dict, keys=None) -> bool:
    return all(torch.equal(a[k], b[k]) for k in (keys or a))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The probes' thread count (python -m harness resolution --threads 1), restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="class")
def engine():
    """One engine for the class, shut down before the tests that build their own (one engine per process)."""
    eng = Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1),
                              dtype=torch.float32, device="cpu", page_size=4, num_page_override=64,
                              max_seq_len_override=64, max_running_req=2))
    torch.set_num_threads(1)  # the engine set its own
    yield eng
    eng.shutdown()


class TestEngineFaults:
    @pytest.mark.parametrize("name", list(ENGINE_FAULTS))
    def test_fault_moves_logits_when_on_and_nothing_when_off(self, engine, name):
        family = FAMILIES[name]
        clean = _logprobs(engine)
        with family.plant(0.0, engine):
            zero = _logprobs(engine)
        with family.plant(ENGINE_FAULTS[name], engine):
            faulty = _logprobs(engine)
        after = _logprobs(engine)
        assert _same(clean, zero) and _same(clean, after), "a fault of size 0, or one left, changed the engine"
        moved = max(float((faulty[k] - clean[k]).abs().max()) for k in clean)
        assert moved > 1e-3, f"{name}: the logits moved by {moved:.2g} only"
        if name == "softmax-decode":  # one path only: the prefill positions are untouched
            prefill = [(uid, pos) for uid, p in enumerate(PROMPTS) for pos in range(len(p) - 1)]
            assert _same(clean, faulty, prefill)


@pytest.mark.parametrize("name", list(SAMPLER_FAULTS))
def test_sampler_fault_moves_tokens_when_on_and_nothing_when_off(name):
    rows = 512
    logits = torch.tensor([L12] * rows)
    sampler = Sampler(torch.device("cpu"), len(L12))
    batch = make_batch([SP(1.0, p=0.5)] * rows)

    def tokens() -> torch.Tensor:
        args = sampler.prepare(batch)
        args.uniforms = torch.linspace(0.0, 1.0 - 1e-9, rows, dtype=torch.float64)
        return sampler.sample(logits, args)

    clean = tokens()
    with FAMILIES[name].plant(0.0, None):
        zero = tokens()
    with FAMILIES[name].plant(SAMPLER_FAULTS[name], None):
        faulty = tokens()
    assert torch.equal(clean, zero) and torch.equal(clean, tokens())
    assert int((faulty != clean).sum()) > 0


def test_lost_writes_are_a_nested_fraction():
    slots = torch.arange(100_000)
    small, large = lost_writes(slots, 3, 0.01), lost_writes(slots, 3, 0.05)
    assert abs(float(small.double().mean()) - 0.01) < 1e-3 and bool((large | ~small).all())
    assert not lost_writes(slots, 3, 0.0).any()


def test_bisection_brackets_a_known_threshold():
    threshold = 0.0123
    search = find_threshold(lambda e: Verdict(e >= threshold), 1e-4, 1.0, ratio=1.25)
    assert search.status == "bracketed"
    assert search.largest_missed < threshold <= search.smallest_detected
    assert search.smallest_detected / search.largest_missed <= 1.25
    assert len(search.probes) == 2 + int(np.ceil(np.log2(np.log(1e4) / np.log(1.25))))


def test_bisection_checks_the_ends():
    never = find_threshold(lambda e: Verdict(False), 1e-4, 1.0)
    always = find_threshold(lambda e: Verdict(True), 1e-4, 1.0)
    assert never.status == "missed at e_max" and never.smallest_detected is None and len(never.probes) == 1
    assert always.status == "detected at e_min" and always.largest_missed is None and len(always.probes) == 2
    with pytest.raises(ValueError, match="e_min < e_max"):
        find_threshold(lambda e: Verdict(True), 1.0, 0.1)


def test_fp32_parity_probe_sees_a_one_percent_decode_scale_error():
    check = ParityCheck("tiny-qwen3", path="batch")
    try:
        assert not check.baseline().detected
        assert check.probe(FAMILIES["softmax-decode"], 0.01).detected
        assert not check.probe(FAMILIES["softmax-decode"], 0.0).detected
        assert check.builds == 1  # one engine for every probe
    finally:
        check.close()


def test_component_probe_sees_a_one_percent_decode_scale_error():
    """On the CPU the torch implementation stands on both sides of the component check: its measure's resolution."""
    check = ComponentCheck("cpu")
    assert check.probe(FAMILIES["softmax-decode"], 0.01).detected
    assert not check.probe(FAMILIES["softmax-decode"], 0.0).detected


def test_fuzz_probe_sees_a_doubled_decode_scale():
    check = FuzzCheck("cpu", budget=2.0)
    try:
        assert check.probe(FAMILIES["softmax-decode"], 1.0).detected
    finally:
        check.close()


def test_resolution_of_bf16_parity_on_the_cpu_without_a_cpu_bf16_golden_is_one_line(capsys: pytest.CaptureFixture):
    assert main(["resolution", "--check", "parity-bf16", "--model", "tiny-qwen3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no golden for tiny-qwen3 on cpu in bfloat16") and "\n" not in err, err
    assert "python -m harness golden --model tiny-qwen3 --device cpu --dtype bfloat16" in err, err


def test_resolution_command_writes_under_build_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    committed, build = tmp_path / "reports", tmp_path / "build" / "reports"
    monkeypatch.setattr(report, "REPORTS_DIR", committed)
    monkeypatch.setattr(report, "BUILD_REPORTS_DIR", build)
    # the search range in one bracket: the baseline and the two ends only
    assert main(["resolution", "--check", "parity-fp32", "--model", "tiny-qwen3", "--family", "softmax-prefill",
                 "--ratio", "1e7"]) == 0
    assert sorted(p.name for p in (build / "resolution").iterdir()) == ["cpu.json", "cpu.md"]
    assert not committed.exists()
    text = (build / "resolution" / "cpu.md").read_text()
    assert "| parity float32 tiny-qwen3 (batch) | softmax-prefill |" in text


# ---------------------------------------------------------------------------------------------- on the GPU
def _cuda_engine() -> Engine:
    """bf16, FlashInfer attention and fused ops, decode graphs for batches of 1 and 2."""
    return Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1),
                               dtype=torch.bfloat16, device="cuda", page_size=4, num_page_override=64,
                               max_seq_len_override=64, max_running_req=2))


def _run_fresh(family: Family | None = None, e: float = 0.0) -> Dict[Tuple[int, int], torch.Tensor]:
    """The short run on an engine built here (inside the family's fault, when given), then shut down."""
    with family.plant(e, None) if family is not None else contextlib.nullcontext():
        eng = _cuda_engine()
        try:
            return _logprobs(eng)
        finally:
            eng.shutdown()


BAKED = ("softmax-decode", "softmax-prefill", "kv-wrong-slot")  # what decode and prefill graphs capture


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(ENGINE_FAULTS))
def test_fault_acts_on_flashinfer_with_decode_graphs(name):
    family, e = FAMILIES[name], ENGINE_FAULTS[name]
    eng = _cuda_engine()
    try:
        assert eng.config.attention_backend == "flashinfer" and eng.graph_runner.graphs
        clean = _logprobs(eng)
        baked = family.baked(eng)
        assert baked == (name in BAKED)
        if not baked:
            with family.plant(0.0, eng):
                zero = _logprobs(eng)
            with family.plant(e, eng):
                faulty = _logprobs(eng)
            after = _logprobs(eng)
        elif name == "softmax-decode":  # the captured graphs keep the scale they were captured with
            with family.plant(e, eng):
                assert _same(clean, _logprobs(eng)), "the decode graphs took a scale planted after capture"
    finally:
        eng.shutdown()
    if baked:
        zero, faulty, after = _run_fresh(family, 0.0), _run_fresh(family, e), _run_fresh()
    assert _same(clean, zero) and _same(clean, after)
    assert max(float((faulty[k] - clean[k]).abs().max()) for k in clean) > 1e-2


@pytest.mark.cuda
def test_bf16_parity_probe_on_graphs_sees_a_quarter_decode_scale_error():
    """The probe of a fault the graphs bake builds its engine inside the fault (test_cuda_gate's 1.25 x scale)."""
    check = ParityCheck("tiny-qwen3", "cuda", "bfloat16", path="batch")
    try:
        assert not check.baseline().detected
        assert check.probe(FAMILIES["softmax-decode"], 0.25).detected
        assert not check.probe(FAMILIES["rope-base"], 0.0).detected
        assert check.builds == 3  # the clean engine, the faulty one, the clean one again
    finally:
        check.close()
