"""The doors to other engines (harness.subjects): every verb through --engine, on engines the harness did not build.

An OpenAI-compatible server of the project's own (`python -m harness serve`) stands for a server of another kind: it
is reached only over HTTP, through the `openai:` door, as vLLM's or SGLang's would be. The faults planted
(tests/peer_faults.py) have known sizes: a 2% attention-output weight (parity), and two sampler rules that differ
from the spec's by a stated total variation on the case built to tell them apart (the report's `separation`). The
real vLLM runs in the test marked `vllm` (nox -s peer-vllm builds its virtualenv)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import zoo
from harness.__main__ import main
from harness.compare import compare_row, compare_topk
from harness.subjects.server import Server
from harness.subjects.vllm import interpreter

MODEL = "tiny-qwen3"
TESTS = Path(__file__).parent


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[str]:
    """A server over the engine the test names (param: python:MODULE:CLASS, default this engine): its URL."""
    server = Server(getattr(request, "param", "engine"), zoo.path(MODEL))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.url
    finally:
        server.close()


# ------------------------------------------------------------------------------------------- the top-k bound
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2 ** 31), vocab=st.integers(8, 300), k=st.integers(1, 64),
       scale=st.floats(1e-6, 1.0), sharp=st.floats(0.1, 8.0))
def test_a_black_boxs_top_k_never_overstates_the_error(seed: int, vocab: int, k: int, scale: float,
                                                        sharp: float) -> None:
    """compare_topk on the engine's top-k alone is a lower bound of compare_row on its whole row (err, KL and TV),
    and equal to it where the top-k holds every golden id: a FAIL on a black box is never a false alarm."""
    g = torch.Generator().manual_seed(seed)
    golden = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * sharp, dim=-1)
    engine = torch.log_softmax(golden + scale * torch.randn(vocab, generator=g, dtype=torch.float64), dim=-1)
    kk = min(64, vocab)
    gtop = golden.topk(kk)
    g_ids, g_lp = gtop.indices.numpy(), gtop.values.numpy()
    full = compare_row(engine.float(), g_ids, g_lp)
    top = engine.topk(min(k, vocab))
    bound = compare_topk(top.indices.numpy(), top.values.numpy(), g_ids, g_lp)
    # full is computed from the float32 row the driver hands it: both sides agree to its rounding
    assert bound.err <= full.err + 1e-6 and bound.kl <= full.kl + 1e-6 and bound.tv <= full.tv + 1e-6
    if set(g_ids.tolist()) <= set(top.indices.tolist()):
        assert bound.err == pytest.approx(full.err, abs=1e-6)


def test_the_bound_sees_a_golden_token_the_engine_ranks_below_its_top_k() -> None:
    """The golden's top token at -0.1, missing from an engine's top-2 whose 2nd is -3: err >= 2.9."""
    stat = compare_topk(np.array([5, 6]), np.array([-1.0, -3.0]), np.array([7, 5]), np.array([-0.1, -2.5]))
    assert stat.err == pytest.approx(2.9) and stat.argmax == 5


# ------------------------------------------------------------------------------------- parity through doors
def test_parity_through_the_openai_door_passes_this_engine(served: str, capsys: pytest.CaptureFixture) -> None:
    rc, out = _run(capsys, "parity", "--model", MODEL, "--engine", f"openai:{served}", "--no-sampling",
                   "--no-report")
    assert rc == 0, out
    for path in ("batch", "single", "free"):
        assert any(f" {path} " in ln and "PASS" in ln for ln in out.splitlines() if ln.startswith("parity ")), out


@pytest.mark.parametrize("served", ["python:peer_faults:PlantedOProj"], indirect=True)
def test_parity_through_the_openai_door_finds_a_planted_weight_fault(served: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    junit = tmp_path / "parity.xml"
    rc, out = _run(capsys, "parity", "--model", MODEL, "--engine", f"openai:{served}", "--no-sampling",
                   "--no-report", "--path", "batch", "--junit", str(junit))
    assert rc == 1, out
    assert "first failure:" in out and f"--engine openai:{served}" in out, out
    assert "<failure" in junit.read_text()


def test_a_black_box_is_refused_what_only_a_driven_engine_has(served: str, capsys: pytest.CaptureFixture) -> None:
    for extra in (["--path", "paged"], ["--batch-invariant"]):
        rc, out = _run(capsys, "parity", "--model", MODEL, "--engine", f"openai:{served}", "--no-report", *extra)
        assert rc == 2 and "runs the paths batch, single, free" in out and out.strip().count("\n") == 0, out


@pytest.mark.parametrize("spec, says", [
    ("sglang", "give one of engine, python:MODULE:CLASS, vllm, openai:URL"),
    ("openai:localhost:8000", "give the server's address"),
    ("openai:http://127.0.0.1:9", "no server answers there"),
])
def test_an_engine_that_cannot_be_reached_is_refused_in_one_line(spec: str, says: str,
                                                                 capsys: pytest.CaptureFixture) -> None:
    rc, out = _run(capsys, "parity", "--model", MODEL, "--engine", spec, "--no-sampling", "--no-report")
    assert rc == 2 and says in out and out.strip().count("\n") == 0, out


def test_a_vllm_without_its_virtualenv_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", "/nonexistent/bin/python")
    rc, out = _run(capsys, "parity", "--model", MODEL, "--engine", "vllm", "--no-sampling", "--no-report")
    assert rc == 2 and "nox -s peer-vllm" in out and out.strip().count("\n") == 0, out


def test_a_server_short_of_top_20_is_told_in_one_line(capsys: pytest.CaptureFixture) -> None:
    server = Server("engine", zoo.path(MODEL), max_logprobs=5)  # e.g. OpenAI's own API caps logprobs at 5
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc, out = _run(capsys, "parity", "--model", MODEL, "--engine", f"openai:{server.url}", "--no-sampling",
                       "--no-report", "--path", "batch")
    finally:
        server.close()
    assert rc == 2 and "logprobs=20" in out and out.strip().count("\n") == 0, out


# ----------------------------------------------------------------------------------- sampling through doors
def _sampling(capsys: pytest.CaptureFixture, spec: str, out: Path, *cases: str) -> tuple[int, str, dict]:
    args = ["sampling", "--engine", spec, "--real-model", MODEL, "--draws", "1000", "--out", str(out)]
    rc, text = _run(capsys, *args, *(x for c in cases for x in ("--case", c)))
    return rc, text, {r["case"]: r for r in json.loads((out / "sampling.json").read_text())["rows"]}


def test_sampling_through_the_python_door_passes_this_engines_sampler(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    rc, out, rows = _sampling(capsys, "python:engine:Engine", tmp_path)
    assert rc == 0, out
    assert {"temperature-1", "top-k", "top-p", "min-p", "greedy", "order", "min-p-temperature"} <= set(rows)
    assert rows["order"]["follows"] == rows["min-p-temperature"]["follows"] == "the spec's", rows


def test_sampling_through_the_python_door_finds_and_names_top_p_over_the_full_mass(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc, out, rows = _sampling(capsys, "python:peer_faults:TopPOfFullMass", tmp_path, "order", "top-p")
    assert rc == 1, out
    order = rows["order"]
    assert not order["passed"] and order["follows"] == "top-p over the full distribution", order
    assert order["separation"] > order["detectable_tv"], order  # the fault's size, and what the draws detect
    assert rows["top-p"]["passed"], rows  # top-p alone is the same rule either way


@pytest.mark.parametrize("served", ["python:peer_faults:MinPUntempered"], indirect=True)
def test_sampling_through_the_openai_door_finds_and_names_min_p_untempered(served: str, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    rc, out, rows = _sampling(capsys, f"openai:{served}", tmp_path, "min-p-temperature", "min-p")
    assert rc == 1, out
    row = rows["min-p-temperature"]
    assert not row["passed"] and row["follows"] == "min-p against the untempered distribution", row
    assert rows["min-p"]["passed"], rows  # at temperature 1 both rules are one
    assert "unseeded" in (tmp_path / "sampling.md").read_text()


def test_a_server_that_refuses_every_sampling_case_is_told_in_one_line(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """A server that returns no log-probabilities (max_logprobs 0) refuses every case's request (HTTP 400): each case is
    left out with what it said, and with none left to run the verb ends in one line (exit 2), never a traceback."""
    server = Server("engine", zoo.path(MODEL), max_logprobs=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc, out = _run(capsys, "sampling", "--engine", f"openai:{server.url}", "--real-model", MODEL, "--draws", "10",
                       "--out", str(tmp_path), "--case", "greedy", "--case", "top-k")
    finally:
        server.close()
    last = out.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in out, out
    assert last.startswith("error: ") and "refuses every sampling case" in last and "max_logprobs 0" in last, out
    assert out.count("LEFT OUT") == 2, out


def test_sampling_through_the_openai_door_passes_this_engine(served: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    rc, out, rows = _sampling(capsys, f"openai:{served}", tmp_path, "temperature-1", "top-k", "order", "greedy")
    assert rc == 0 and all(r["passed"] and not r["left_out"] for r in rows.values()), out
    assert f"--engine openai:{served} (harness serve)" in (tmp_path / "sampling.md").read_text().splitlines()[0]


# -------------------------------------------------------------------------------------- bench through doors
def test_bench_against_a_slowed_engine_finds_it_slower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The other engine computes every forward four times: each row's whole interval says this engine is faster, on a
    busy host too (what the host does meanwhile hits both sides of a pair, and stretches both sides' work)."""
    from harness import report

    monkeypatch.setattr(report, "BUILD_REPORTS_DIR", tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    rc, out = _run(capsys, "bench", "--engine", "python:peer_faults:SlowForward", "--model", MODEL, "--repeats", "8")
    assert rc == 0, out
    rows = json.loads((tmp_path / "peers" / "python-peer_faults-SlowForward" / "bench" / "cpu" / MODEL /
                       "peer.json").read_text())["rows"]
    shown = [(r["workload"], round(r["ratio"], 2), round(r["low"], 2), round(r["high"], 2)) for r in rows]
    assert len(rows) == 6 and all(r["verdict"] == "this engine faster" and r["low"] > 1 for r in rows), shown


# ---------------------------------------------------------------------------------------------- real vLLM
@pytest.mark.vllm
def test_the_real_vllm_passes_parity_and_sampling(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    try:
        interpreter()
    except Exception as e:
        pytest.skip(str(e))
    rc, out = _run(capsys, "parity", "--model", MODEL, "--engine", "vllm", "--no-sampling", "--no-report")
    assert rc == 0, out
    rc, out, rows = _sampling(capsys, "vllm", tmp_path, "order", "min-p-temperature")
    assert rc == 0 and all(r["follows"] == "the spec's" for r in rows.values()), out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
def test_vllms_own_server_holds_every_door(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """vLLM's OpenAI server, as `vllm serve` runs (fp32): parity passes through the `openai:` door, every sampling
    case runs (greedy too: vLLM refuses n > 1 at temperature 0, and the door asks it one choice a request), the bench
    runs, and each report names the server."""
    from harness import report
    from harness.subjects.vllm_server import served

    try:
        interpreter()
    except Exception as e:
        pytest.skip(str(e))
    monkeypatch.setattr(report, "BUILD_REPORTS_DIR", tmp_path)
    with served(zoo.path(MODEL), _free_port()) as url:
        spec = f"openai:{url}"
        rc, out = _run(capsys, "parity", "--model", MODEL, "--engine", spec, "--no-sampling", "--path", "batch")
        assert rc == 0 and f"(--engine {spec} (vllm 0." in out, out
        rc, out, rows = _sampling(capsys, spec, tmp_path / "sampling", "greedy", "top-k", "order")
        assert rc == 0 and all(r["passed"] and not r["left_out"] for r in rows.values()), out
        assert f"--engine {spec} (vllm 0." in (tmp_path / "sampling" / "sampling.md").read_text().splitlines()[0]
        rc, out = _run(capsys, "bench", "--engine", spec, "--model", MODEL, "--repeats", "2")
        assert rc == 0, out
    peer = next((tmp_path / "peers").glob("*/bench/cpu/*/peer.md")).read_text()
    assert f"--engine {spec} (vllm 0." in peer.splitlines()[0], peer[:300]
