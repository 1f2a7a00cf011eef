"""bench --against --fail-if-slower PCT: a row fails when its whole ratio interval lies beyond PCT percent slower;
just inside and just outside the threshold; the rows are named, the report draws them; through the CLI a side
planted slower fails the gate with exit status 1."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.bench import ab_report
from harness.bench.ab_stats import slower_beyond, threshold_ratio


def test_the_threshold_is_the_ratio_of_a_revision_pct_slower():
    assert threshold_ratio(0) == 1.0
    assert threshold_ratio(25) == pytest.approx(0.8)  # 25% more time: ref / new = 1 / 1.25
    assert threshold_ratio(100) == pytest.approx(0.5)


@pytest.mark.parametrize("pct", [0.0, 2.0, 5.0, 50.0])
def test_just_inside_and_just_outside(pct):
    t = threshold_ratio(pct)
    assert slower_beyond(t * (1 - 1e-9), pct)  # the whole interval a hair beyond: fails
    assert not slower_beyond(t, pct)  # reaching the threshold: the run cannot tell
    assert not slower_beyond(t * (1 + 1e-9), pct)


@given(high=st.floats(1e-3, 10.0), pct=st.floats(0.0, 500.0), more=st.floats(0.0, 500.0))
def test_a_row_failing_a_threshold_fails_every_smaller_one(high, pct, more):
    if slower_beyond(high, pct + more):
        assert slower_beyond(high, pct)
    if high >= 1.0:  # an interval reaching no difference never fails
        assert not slower_beyond(high, pct)


def _row(workload: str, ratio: float, low: float, high: float, verdict: str) -> dict:
    return {"model": "m", "workload": workload, "batch_size": 1, "length": 128, "ratio": ratio, "ci_low": low,
            "ci_high": high, "verdict": verdict}


def test_the_gate_names_the_rows_beyond_it():
    rows = [_row("decode", 0.90, 0.88, 0.93, "slower"),  # at least 7.5% slower
            _row("prefill", 0.96, 0.94, 0.98, "slower"),  # perhaps only 2% slower
            _row("ttft", 1.01, 0.97, 1.05, "no difference")]
    assert ab_report.gate(rows, None) == [] and "gate" not in rows[0]
    failed = ab_report.gate(rows, 5.0)
    assert [r["workload"] for r in failed] == ["decode"] and [r["gate"] for r in rows] == ["FAIL", "pass", "pass"]
    text = ab_report.gate_text(rows, 5.0)
    assert text.splitlines() == ["FAIL: 1 row(s) slower beyond 5%:",
                                 "  m decode bs 1 len 128: ratio 0.900 [0.880, 0.930], at least 7.5% slower"]
    ab_report.gate(rows, 10.0)
    assert ab_report.gate_text(rows, 10.0).startswith("PASS: no row slower beyond 10%")


def test_the_report_draws_every_row_and_the_threshold(tmp_path):
    rows = [_row("decode", 0.90, 0.88, 0.93, "slower"), _row("prefill", 1.0, 0.95, 1.05, "no difference")]
    ab_report.gate(rows, 5.0)
    result = {"spec": {"rounds": 2, "repeats": 2, "decode_ctx": 128, "decode_steps": 8, "prefill_runs": 3,
                       "confidence": 0.95},
              "fail_if_slower_pct": 5.0, "rows": rows, "ref": {"named": "main"}, "new": {"named": "this tree"},
              "host": {"device_name": "a CPU", "dtype": "float32"}}
    md = ab_report.write(result, tmp_path).read_text()
    assert (tmp_path / "against.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![every row's ratio with its interval](against.png)" in md
    assert "**Gate** (`--fail-if-slower 5`)" in md and "- m decode bs 1 len 128: ratio 0.900" in md
    assert json.loads((tmp_path / "against.json").read_text())["fail_if_slower_pct"] == 5.0


def test_a_side_planted_slower_fails_the_gate(monkeypatch, tmp_path, capsys):
    """The whole CLI against this very tree, the new side's every forward slowed by a sleep several times a tiny
    model's step: the decode row slower beyond 5%, exit status 1, the row named; into a scratch report folder. Three
    rounds: with two, t(0.975, 1) = 12.7 widens the interval past the threshold on a loaded 2-core host (a 30 ms
    sleep against steps of 90 ms there: [0.36, 1.65]); decode only: one prefill of 16 tokens a repeat swung
    threefold there (noise 46% a round)."""
    import harness.report
    from harness.__main__ import main
    from harness.bench import against

    class SlowNew(against.Side):
        def __init__(self, name, tree, env=None):
            super().__init__(name, tree, {"AB_STEP_SLEEP_MS": "300"} if name == "new" else env)

    monkeypatch.setattr(against, "Side", SlowNew)
    monkeypatch.setitem(against.SPECS, "cpu", against.AgainstSpec((1,), 16, 2, (), 2))
    monkeypatch.setattr(harness.report, "BUILD_REPORTS_DIR", tmp_path)
    assert main(["bench", "--against", str(against.REPO_ROOT), "--model", "tiny-qwen3", "--rounds", "3",
                 "--repeats", "2", "--fail-if-slower", "5"]) == 1
    out = capsys.readouterr()
    assert "FAIL: 1 row(s) slower beyond 5%:\n  tiny-qwen3 decode bs 1 len 16: ratio" in out.out
    assert out.err.count(f"bench --against {against.REPO_ROOT} tiny-qwen3 round ") == 3
    assert (tmp_path / "bench" / "cpu" / "against.png").is_file()
