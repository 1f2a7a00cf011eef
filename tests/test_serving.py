"""The serving benchmark (bench --serve): vLLM's metric definitions on hand-made timings, the arrival processes, trace
files, the driver admitting requests as they arrive, the command end to end through this engine and the openai door
(this project's server, streamed), and the serving gate finding planted scheduler faults in another revision."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.__main__ import main
from harness.bench.arrivals import (Lengths, Releaser, Timing, Trace, TraceRequest, arrival_times, make_trace,
                                    random_prompts, read_trace, replay)
from harness.bench.serving_metrics import metrics, parse_goodput
from harness.driver import Driver
from harness.subjects.server import Server
from scheduler_faults import planted_tree

MODEL = "tiny-qwen3"
REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ metrics
def test_the_metrics_are_vllms_on_a_hand_made_run():
    """Two requests: sent at 0 and 1 s, chunks at known times (the second's last chunk carries 2 tokens)."""
    a = Timing(10, 0.0, [0.5, 0.7, 1.0], [1, 1, 1])
    b = Timing(20, 1.0, [1.2, 1.3, 2.0], [1, 1, 2])
    failed = Timing(5, 0.5, [], [], "boom")
    m = metrics([a, b, failed], {"ttft": 500, "tpot": 260})
    assert (m["completed"], m["failed"], m["total_input"], m["total_output"]) == (2, 1, 30, 7)
    assert m["duration_s"] == 2.0 and m["request_throughput"] == 1.0 and m["output_throughput"] == 3.5
    assert m["total_token_throughput"] == pytest.approx(18.5)
    assert m["mean_ttft_ms"] == pytest.approx(350) and m["median_ttft_ms"] == pytest.approx(350)
    tpots = [(1.0 - 0.5) / 2, (1.0 - 0.2) / 3]  # (E2EL - TTFT) / (tokens - 1)
    assert m["mean_tpot_ms"] == pytest.approx(1e3 * statistics.fmean(tpots))
    itls = [0.2, 0.3, 0.1, 0.7]  # one gap per chunk after the first, pooled
    assert m["mean_itl_ms"] == pytest.approx(1e3 * statistics.fmean(itls))
    assert m["p99_itl_ms"] == pytest.approx(1e3 * np.percentile(itls, 99))
    assert m["median_e2el_ms"] == pytest.approx(1e3 * statistics.median([1.0, 1.0]))
    assert m["good_requests"] == 1 and m["request_goodput"] == 0.5  # a meets both (at the bound); b: TPOT 267 ms


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=20)), min_size=1,
                max_size=12), st.floats(1, 5000), st.floats(1, 5000))
def test_the_metrics_hold_their_definitions(reqs, ttft_slo, tpot_slo):
    timings = []
    for sent, gaps in reqs:
        times = list(np.cumsum([sent + gaps[0], *gaps[1:]]))
        timings.append(Timing(7, sent, times, [1] * len(times)))
    m = metrics(timings, {"ttft": ttft_slo, "tpot": tpot_slo})
    for k in ("ttft", "tpot", "itl", "e2el"):
        assert m[f"median_{k}_ms"] <= m[f"p90_{k}_ms"] + 1e-9 <= m[f"p99_{k}_ms"] + 2e-9
    assert m["good_requests"] <= m["completed"] == len(reqs)
    assert m["request_goodput"] <= m["request_throughput"]
    assert m["total_output"] == sum(len(g) for _, g in reqs)
    assert m["mean_e2el_ms"] >= m["mean_ttft_ms"] - 1e-9


@pytest.mark.parametrize("bad", [["ttft"], ["speed:3"], ["tpot:x"], ["ttft:-1"]])
def test_a_goodput_slo_is_checked(bad):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(bad)


# ------------------------------------------------------------------------------------------------ arrivals
def test_arrivals_follow_the_rate_and_the_burstiness():
    """The last arrival at n / rate; gaps of coefficient of variation about 1 / sqrt(burstiness) (gamma)."""
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        times = arrival_times(4000, 5.0, burstiness, random.Random(1))
        gaps = np.diff([0.0, *times])
        assert times[-1] == pytest.approx(800.0)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert arrival_times(3, math.inf, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


def test_a_seed_gives_the_same_requests_at_every_rate():
    lengths = Lengths.parse("uniform:64:16:0.5,long:512:0.25")
    slow, fast = (make_trace(random_prompts(1000), lengths, 40, r, 1.0, None, 3) for r in (1.0, 8.0))
    assert [r.prompt for r in slow.requests] == [r.prompt for r in fast.requests]
    assert [r.arrival_s for r in slow.requests] == pytest.approx([8 * r.arrival_s for r in fast.requests])
    lens = [len(r.prompt) for r in slow.requests]
    assert set(lens) - set(range(32, 97)) == {512} and all(1 <= r.output_len <= 24 for r in slow.requests)


@pytest.mark.parametrize("spec", ["normal:1:2", "uniform:64", "uniform:64:16:1.5", "uniform:64:16,long:9",
                                  "uniform:0:16", "lognormal:64:16:0.5,long:100:2"])
def test_a_lengths_spec_is_checked(spec):
    with pytest.raises(ValueError, match="lengths"):
        Lengths.parse(spec)


def test_a_concurrency_cap_holds_back_what_has_arrived():
    trace = Trace([TraceRequest([1], 1, 0.0) for _ in range(5)], concurrency=2)
    clock = iter(range(100)).__next__
    rel = Releaser(trace, clock=lambda: float(clock()))
    assert [i for i, _ in rel.due(0)] == [0, 1]
    assert rel.due(0) == []
    rel.finished(2.5)
    assert rel.due(1) == [(2, 2.5)]  # sent when the slot freed, not at its arrival nor when the replay next looked
    rel.finished(4.0)
    assert rel.due(3) == [(3, 4.0), (4, 4.0)] and rel.done  # the third end was not reported: sent when seen (4.0)


def test_trace_files_in_several_layouts(tmp_path: Path):
    tok = lambda text: [ord(c) for c in text]  # noqa: E731
    lines = [{"timestamp": 100.5, "prompt": "abc", "max_tokens": 4}, {"timestamp": 100.0, "input_len": 6,
                                                                       "output_len": 2}]
    (tmp_path / "t.jsonl").write_text("\n".join(map(json.dumps, lines)))
    trace = read_trace(tmp_path / "t.jsonl", tok, 1000)
    assert [(len(r.prompt), r.output_len, r.arrival_s) for r in trace.requests] == [(6, 2, 0.0), (3, 4, 0.5)]
    ours = make_trace(random_prompts(1000), Lengths.parse("uniform:8:4"), 3, 2.0, 1.0, 2, 0)
    (tmp_path / "ours.json").write_text(json.dumps(ours.to_json()))
    again = read_trace(tmp_path / "ours.json", tok, 1000)
    assert again.requests == ours.requests and again.concurrency == 2
    (tmp_path / "bad.json").write_text(json.dumps([{"prompt": "x"}]))
    with pytest.raises(ValueError, match="arrival time"):
        read_trace(tmp_path / "bad.json", tok, 1000)


def test_text_prompts_are_excerpts_of_the_committed_text():
    """--dataset text: excerpts of the King James text through the model's tokenizer, at the drawn lengths, longer
    ones wrapping around; the same seed, the same excerpts."""
    from transformers import AutoTokenizer

    from harness.bench.serving import text_prompts

    tok = AutoTokenizer.from_pretrained(zoo.path(MODEL))
    excerpts = text_prompts(tok)
    got = excerpts([5, 300, 20000], random.Random(4))
    assert [len(p) for p in got] == [5, 300, 20000] and got == excerpts([5, 300, 20000], random.Random(4))
    assert " the " in tok.decode(got[1]) and tok.decode(got[2]).count("In the beginning God created") >= 1


# ------------------------------------------------------------------------------------------------ the driver
@pytest.fixture  # one engine a process: gone before the next test builds its own
def engine():
    eng = Engine(EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                              device="cpu", max_running_req=4, num_page_override=2048, max_seq_len_override=256))
    yield eng
    eng.shutdown()


def test_the_driver_admits_requests_as_they_arrive(engine):
    """A trace at 20 requests a second, at most 3 in flight: no token before its request was sent, never more than 3
    in flight, and each request's greedy tokens those of the request alone."""
    trace = make_trace(random_prompts(4000), Lengths.parse("uniform:24:8:0.5"), 8, 20.0, 1.0, 3, 5)
    params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)  # noqa: E731
    tokens: dict = {}
    driver = Driver(engine)
    timings = replay(driver, trace, params)
    for t, r in zip(timings, trace.requests):
        assert t.sent >= r.arrival_s - 1e-9 and t.times[0] > t.sent and len(t.times) == r.output_len
    spans = [(t.sent, t.times[-1]) for t in timings]
    assert max(sum(s <= at < e for s, e in spans) for at, _ in spans) <= 3
    driver.serve(_Once(trace, params), on_token=lambda uid, tok, at: tokens.setdefault(uid, []).append(tok))
    for i, r in enumerate(trace.requests):
        assert tokens[i] == Driver(engine).generate([r.prompt], params(r.output_len))[0].output_ids


class _Once:
    """Every request of a trace at once."""

    def __init__(self, trace: Trace, params) -> None:
        from harness.driver import Arrival

        self.todo = [Arrival(i, r.prompt, params(r.output_len)) for i, r in enumerate(trace.requests)]

    def take(self, finished: int, wait: bool):
        todo, self.todo = self.todo, None
        return todo


def test_a_request_that_cannot_fit_is_refused_when_it_arrives(engine):
    trace = Trace([TraceRequest([5] * 300, 4, 0.0)])
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        replay(Driver(engine), trace, lambda n: SamplingParams(max_tokens=n, ignore_eos=True))


# ------------------------------------------------------------------------------------------------ the command
def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


SMALL = ("--model", MODEL, "--num-prompts", "6", "--repeats", "2", "--lengths", "uniform:24:8:0.5,long:200:0.2")


def test_serving_this_engine_and_a_server_on_the_same_traces(capsys, tmp_path: Path, monkeypatch):
    """This engine (its worker) against this project's server behind the openai door, streamed: both engines'
    metrics at each point, their ratios, the JSON, the plot; the same requests complete on both."""
    monkeypatch.setattr("harness.report.BUILD_REPORTS_DIR", tmp_path)
    server = Server("engine", zoo.path(MODEL))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc, out = _run(capsys, "bench", "--serve", *SMALL, "--rate", "10", "--concurrency", "2",
                       "--goodput", "ttft:2000", "tpot:500", "--engine", f"openai:{server.url}")
    finally:
        server.close()
    assert rc == 0, out
    folder = next(tmp_path.glob("peers/*/bench/cpu/tiny-qwen3"))
    result = json.loads((folder / "serve.json").read_text())
    assert (folder / "serve.png").stat().st_size > 0 and "## This engine against the other" in \
        (folder / "serve.md").read_text()
    (point,) = result["points"]
    for engine in point["engines"].values():
        for m in engine["repeats"]:
            assert m["completed"] == 6 and m["failed"] == 0 and m["total_output"] > 6
            assert m["good_requests"] <= 6 and 0 < m["p99_itl_ms"]
    totals = [[m["total_output"] for m in e["repeats"]] for e in point["engines"].values()]
    assert totals[0] == totals[1]  # the same requests, each exactly its output length
    assert set(point["comparison"]) >= {"p99_ttft_ms", "p99_tpot_ms", "output_throughput"}


@pytest.mark.parametrize("argv, says", [
    (["--lengths", "uniform:1"], "give uniform:IN:OUT"),
    (["--goodput", "ttft"], "--goodput ttft: give KEY:MS"),
    (["--rate", "0"], "give a rate above 0"),
    (["--rate", "1", "--rate", "2", "--concurrency", "2"], "take one rate"),
    (["--trace", "/nonexistent.json"], "no such file"),
    (["--stall", "1"], "give more than 1"),
])
def test_a_serving_run_that_cannot_run_is_refused_in_one_line(capsys, argv, says):
    rc, out = _run(capsys, "bench", "--serve", "--model", MODEL, *argv)
    assert rc == 2 and says in out and out.strip().count("\n") == 0, out


def test_serving_flags_need_serve(capsys):
    rc, out = _run(capsys, "bench", "--model", MODEL, "--rate", "2")
    assert rc == 2 and "add --serve" in out


# ------------------------------------------------------------------------------------------------ the gate
@pytest.mark.parametrize("fault", ["chunk-ignores-budget", "decodes-starved"])
def test_the_serving_gate_finds_a_planted_scheduler_fault(fault, tmp_path: Path):
    """A revision with the fault (a copy of this tree, its driver edited) against this tree, on a trace file: six
    requests decoding 192 tokens, four 4k-token prompts (above the driver's token budget) arriving among them. Their
    chunks stall the running requests, and the gate names the p99 inter-token latency."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(10, 4000) for _ in range(n)]  # noqa: E731
    trace = ([{"arrival_s": 0.0, "prompt_ids": ids(16), "output_len": 192} for _ in range(6)] +
             [{"arrival_s": at, "prompt_ids": ids(4096), "output_len": 2} for at in (0.1, 0.3, 0.5, 0.7)])
    (tmp_path / "trace.json").write_text(json.dumps(trace))
    tree = planted_tree(fault, tmp_path / "tree")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-m", "harness", "bench", "--serve", "--against", str(REPO), "--model",
                          MODEL, "--trace", str(tmp_path / "trace.json"), "--repeats", "3", "--rounds", "3",
                          "--fail-if-slower", "20"], cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    failed = [line for line in out.stdout.splitlines() if line.startswith("  ") and "at least" in line]
    assert any("p99_itl_ms" in line for line in failed), out.stdout


@pytest.mark.vllm
def test_serving_this_engine_and_the_real_vllm(capsys, tmp_path: Path, monkeypatch):
    """vLLM's async engine in its virtualenv's worker on the same traces: every request completes, exactly its
    output length, on both."""
    from harness.subjects.vllm import interpreter

    try:
        interpreter()
    except Exception as e:
        pytest.skip(str(e))
    monkeypatch.setattr("harness.report.BUILD_REPORTS_DIR", tmp_path)
    rc, out = _run(capsys, "bench", "--serve", *SMALL, "--rate", "inf", "--engine", "vllm")
    assert rc == 0, out
    (point,) = json.loads((tmp_path / "peers" / "vllm" / "bench" / "cpu" / MODEL / "serve.json").read_text())["points"]
    totals = [[(m["completed"], m["total_output"]) for m in e["repeats"]] for e in point["engines"].values()]
    assert totals[0] == totals[1] and all(c == 6 for c, _ in totals[0])
