"""JUnit XML as CI reads it (counts, a failure's message and text, characters XML must escape) and the parity
headline each failing path carries; the progress lines and bars: plain text off a terminal."""

from __future__ import annotations

import io
import re
import sys
import xml.etree.ElementTree as ET

from harness import junit, progress
from harness.parity.gate import ParityResult, PathResult, PromptResult, Where


def _result() -> ParityResult:
    div = {"step": 3, "position": 12, "golden_token": 5, "engine_token": 7, "golden_logprob_gap": 2.0,
           "near_tie": False, "router_near_tie": False, "engine_token_rank_in_golden": 1,
           "golden_token_rank_in_engine": 1}
    top = [[5, -0.1], [7, -2.1]]
    r = ParityResult("tiny-qwen3", "cpu", "float32", tol=1e-4, hf_spread=2e-5, obtained="golden.obtained.npz")
    r.prompts = [PromptResult("batch", "short", passed=True),
                 PromptResult("batch", "chat", index=1, divergence=div, passed=False,
                              reason="token differs at step 3 and it is not a near tie",
                              failure=Where(1, 12, 3, 0.0, top, top[::-1])),
                 PromptResult("paged", "short", max_err_prefill=0.5, passed=False, reason="logprob error 0.5 > tol",
                              failure=Where(0, 2, None, 0.5, top, top)),
                 PromptResult("prefix", "short", passed=True)]
    r.paths = [PathResult("batch", 40, {}, None, seconds=1.5), PathResult("paged", 40, {}, None),
               PathResult("prefix", 40, {}, None),
               PathResult("free", 40, {"kl_mean": 2e-5}, {"kl_mean": 1e-5}, passed=False,
                          reason="kl_mean 2e-05 > 1e-05", worst_kl=Where(0, 7, 1, 3e-4, top, top))]
    return r


def test_each_failing_path_says_where_it_first_failed():
    r = _result()
    assert junit.parity_headline(r, "batch") == (
        "first failure: model tiny-qwen3, dtype float32, path batch, prompt 1, position 12 (decode step 3): greedy "
        "divergence at decode step 3: golden token 5 vs engine 7; the golden's logprob gap between them 2 > near-tie "
        "tolerance 0")
    assert junit.parity_headline(r, "paged").startswith(
        "first failure: model tiny-qwen3, dtype float32, path paged, prompt 0, position 2 (prefill): largest logprob "
        "err 0.5")
    assert junit.parity_headline(r, "free").startswith(
        "first failure: model tiny-qwen3, dtype float32, path free, prompt 0, position 7 (decode step 1): "
        "distribution gate over 40 positions: kl_mean 2e-05 > 1e-05")
    assert junit.parity_headline(r, "prefix") is None


def test_the_xml_counts_and_carries_each_failure(tmp_path):
    suite = junit.parity_suite(_result())
    odd = junit.Suite("odd", [junit.TestCase("odd", "<&\">", 0.25, "a < b & c\nsecond line")])
    root = ET.parse(junit.write(tmp_path / "sub" / "junit.xml", [suite, odd])).getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("5", "4", "0")
    cases = root.findall("./testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases][:2] == [
        ("parity.tiny-qwen3.cpu-float32", "batch"), ("parity.tiny-qwen3.cpu-float32", "paged")]
    assert cases[0].get("time") == "1.500"
    batch = cases[0].find("failure")
    assert batch.get("message").startswith("first failure: model tiny-qwen3, dtype float32, path batch, prompt 1, "
                                           "position 12 (decode step 3)")
    assert batch.text.splitlines()[1:] == ["prompt chat: token differs at step 3 and it is not a near tie",
                                           "the engine's result: golden.obtained.npz"]
    assert cases[2].find("failure") is None
    assert (cases[4].get("name"), cases[4].find("failure").get("message")) == ("<&\">", "a < b & c")


def test_progress_off_a_terminal_is_plain_lines(monkeypatch):
    err = io.StringIO()  # not a terminal, as a CI log's pipe
    monkeypatch.setattr(sys, "stderr", err)
    assert not progress.interactive()
    with progress.bar(range(3), desc="work") as bar:
        assert bar.disable
        for _ in bar:
            pass
    progress.line("parity", "tiny-qwen3 cpu float32 batch", "PASS", 3.24)
    out = err.getvalue()
    assert "\r" not in out and "\x1b" not in out
    assert re.fullmatch(r"parity tiny-qwen3 cpu float32 batch +PASS +3\.2 s\n", out), repr(out)

