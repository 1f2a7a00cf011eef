"""bench --against: the paired-ratio and rounds statistics on known samples; through real runner processes, two
identical engines show no difference (the interval covers 1) and a planted sleep per forward is found slower, by the
time it adds; a bias planted per process (a sleep one process of each round has) is a false difference within a
round and none over the rounds; `--against HEAD` runs end to end from a temporary worktree, which is removed
afterwards."""

from __future__ import annotations

import dataclasses
import math
import statistics
import subprocess

import pytest

from harness.__main__ import build_parser
from harness.bench.ab_stats import paired_ratio, rounds_ratio
from harness.bench.against import AgainstSpec, Side, _setup, compare_rows, measure, measure_rounds, run_against
from harness.report import REPO_ROOT

SLEEP_S = 0.1  # planted per forward: large against a tiny model's step, even on a loaded host
# a sleep never returns early, so the A/B must find most of the time planted: the pairs' median difference, at least
# 0.8 x SLEEP_S (it also carries both sides' own steps, which a loaded host stretches on either side: 0.097 s for 0.1
# planted with both of 2 cores busy; a missed sleep reads about 0). Above it, a busy host adds its scheduling (0.13 s
# for 0.1 beside a package install on 2 cores), which says nothing of the A/B and is not bounded
ADDED_AT_LEAST = 0.8 * SLEEP_S
BIAS_S = 0.15  # the per-process bias: above the 0.1-0.35 s stalls a loaded host gives a busy process
# confidence 0.999: the identical pair's false-alarm rate is 0.1% per workload
SPEC = AgainstSpec(decode_bs=(1,), decode_ctx=16, decode_steps=4, prefill_lengths=(16,), repeats=6, confidence=0.999)
# the planted pair is judged at the A/B's default confidence, 0.95: it is slower, so no false alarm is at stake there,
# and 0.999's interval (t 6.87 on 6 pairs, against 2.57) let one stalled reference step on a loaded host (0.076 s for
# 0.008) pull a 10x slower side's interval across 1
PLANTED = dataclasses.replace(SPEC, confidence=0.95)


def test_paired_ratio_on_known_samples():
    ref = [1.0, 1.2, 0.9, 1.1]
    exact = paired_ratio(ref, [2 * r for r in ref])  # every pair exactly twice as slow: no spread
    assert (exact.ratio, exact.low, exact.high, exact.verdict) == (0.5, 0.5, 0.5, "slower")
    assert paired_ratio([2 * r for r in ref], ref).verdict == "faster"
    logs = [0.05, -0.02, 0.01, -0.04]  # log(ref / new) by pair
    got = paired_ratio([math.exp(d) for d in logs], [1.0] * 4, confidence=0.95)
    half = 3.182446305284263 * statistics.stdev(logs) / 2  # t(0.975, 3) x sd / sqrt(4)
    assert got.ratio == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (got.low, got.high) == pytest.approx((math.exp(-half), math.exp(half)))  # the mean log ratio is 0
    assert got.verdict == "no difference" and got.low < 1 < got.high
    with pytest.raises(ValueError, match="at least 2"):
        paired_ratio([1.0], [1.0])
    # rounds: the interval over the rounds' mean log ratios, whatever the spread inside a round
    rounds = [[0.08, 0.12], [-0.01, 0.01], [0.05, 0.03]]  # log(ref / new) by round and pair; means 0.1, 0, 0.04
    got = rounds_ratio([[math.exp(d) for d in r] for r in rounds], [[1.0, 1.0]] * 3, confidence=0.95)
    means = [0.1, 0.0, 0.04]
    half = 4.302652729911275 * statistics.stdev(means) / math.sqrt(3)  # t(0.975, 2)
    assert got.ratio == pytest.approx(math.exp(statistics.fmean(means)))
    assert (got.low, got.high) == pytest.approx((math.exp(statistics.fmean(means) - half),
                                                 math.exp(statistics.fmean(means) + half)))
    assert got.n == 3 and got.noise == pytest.approx(statistics.stdev(means)) and got.verdict == "no difference"
    one = rounds_ratio([[1.0, 1.2, 0.9]], [[2.0, 2.4, 1.8]])  # one round: the pairs' interval
    assert (one.ratio, one.n, one.verdict) == (0.5, 3, "slower")


def test_identical_engines_agree_and_a_planted_sleep_is_slower():
    setup = _setup("tiny-qwen3", "cpu", SPEC)
    sides = [Side("ref", REPO_ROOT), Side("new", REPO_ROOT),
             Side("slow", REPO_ROOT, {"AB_STEP_SLEEP_MS": str(1e3 * SLEEP_S)})]
    try:
        samples = measure(sides, setup, SPEC)
    finally:
        for side in sides:
            side.close()
    for same, slow in zip(compare_rows("tiny-qwen3", SPEC, [samples], "ref", "new"),
                          compare_rows("tiny-qwen3", PLANTED, [samples], "ref", "slow")):
        # each of the slow side's measured forwards slept SLEEP_S: the median of its pairs' differences is that
        added = statistics.median(s - r for r, s in zip(slow["ref_samples"][0], slow["new_samples"][0]))
        print(f"{same['workload']}: identical {same['ratio']:.3f} [{same['ci_low']:.3f}, {same['ci_high']:.3f}]; "
              f"planted {slow['ratio']:.3f} [{slow['ci_low']:.3f}, {slow['ci_high']:.3f}], added {added:.4f} s")
        # what the A/B must show, not how fast the host is: identical sides not called different (the interval
        # covers 1), the planted side slower (its whole interval below 1) by most of the time planted
        assert same["verdict"] == "no difference" and same["ci_low"] <= 1 <= same["ci_high"], same["workload"]
        assert slow["verdict"] == "slower" and slow["ci_high"] < 1, slow["workload"]
        assert added >= ADDED_AT_LEAST, f"{slow['workload']}: {added:.4f} s found of {SLEEP_S} s planted"


def test_a_bias_of_each_process_is_noise_over_rounds():
    """One tree on both sides; in each round one of the two processes sleeps BIAS_S a forward, the ref side's in even
    rounds and the new side's in odd ones (a process slower for its whole life, as a real one can be). Within a round
    the pairs see a difference that is only that process's; over the rounds the interval covers 1."""
    spec = dataclasses.replace(SPEC, rounds=4, repeats=3, confidence=0.95)
    setup = _setup("tiny-qwen3", "cpu", spec)
    sleep = {"AB_STEP_SLEEP_MS": str(1e3 * BIAS_S)}

    def sides(r: int) -> list:
        return [Side("ref", REPO_ROOT, sleep if r % 2 == 0 else None), Side("new", REPO_ROOT, sleep if r % 2 else None)]
    rounds = measure_rounds(sides, setup, spec)
    for w, row in enumerate(compare_rows("tiny-qwen3", spec, rounds, "ref", "new")):
        per_round = [compare_rows("tiny-qwen3", spec, [rnd], "ref", "new")[w] for rnd in rounds]
        print(row["workload"], [f"{p['ratio']:.2f} {p['verdict']}" for p in per_round],
              f"over rounds {row['ratio']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]")
        # each round's ratio points at its slow process (its verdict, from 3 pairs, can miss on a loaded host: a
        # concurrent job left one round at 0.39 "no difference")
        assert [p["ratio"] > 1 for p in per_round] == [True, False] * 2
        assert row["verdict"] == "no difference" and row["rounds"] == 4 and row["repeats"] == 12


def test_against_head_runs_end_to_end(tmp_path):
    args = build_parser().parse_args(["bench", "--against", "HEAD", "--repeats", "2", "--rounds", "2"])
    assert (args.against, args.repeats, args.rounds) == ("HEAD", 2, 2)
    spec = AgainstSpec(decode_bs=(1,), decode_ctx=16, decode_steps=3, prefill_lengths=(16,), repeats=2, rounds=2)
    result = run_against("HEAD", "cpu", ["tiny-qwen3"], spec, tmp_path)
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert result["ref"]["commit"] == head.stdout.strip() and result["new"]["tree"] == "this checkout"
    assert [(r["workload"], r["rounds"], r["repeats"]) for r in result["rows"]] == [("decode", 2, 4), ("prefill", 2, 4)]
    assert all(r["verdict"] in ("faster", "slower", "no difference") for r in result["rows"])
    md = (tmp_path / "against.md").read_text()
    assert "## Reference: HEAD" in md and "## New: this tree" in md and (tmp_path / "against.json").is_file()
    worktrees = subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "list"], capture_output=True, text=True)
    assert result["ref"]["tree"] not in worktrees.stdout  # the temporary checkout is gone


def test_a_side_finds_its_own_engine_first_and_keeps_other_packages(tmp_path):
    """A side's PYTHONPATH: its tree, then the inherited folders (kernels installed to a folder on the GPU machine),
    without another checkout of the project (whose engine would stand in for a module the side's tree lacks)."""
    from harness.bench.against import side_path

    other, site = tmp_path / "other", tmp_path / "site"
    (other / "engine").mkdir(parents=True)
    (other / "engine" / "__init__.py").write_text("")
    site.mkdir()
    tree = tmp_path / "tree"
    assert side_path(tree, f"{site}:{other}::") == f"{tree}:{site}"
    assert side_path(tree, "") == str(tree)


def test_a_folder_inside_a_checkout_is_not_credited_with_its_commit(tmp_path):
    """An exported revision inside this checkout names no commit (it is not HEAD's code); a checkout of its own
    names its HEAD."""
    from harness.bench.against import tree_provenance

    inside = REPO_ROOT / "build" / "against-provenance-test"
    inside.mkdir(parents=True, exist_ok=True)
    try:
        assert tree_provenance(inside, "x")["commit"] == "not a git checkout"
    finally:
        inside.rmdir()
    assert tree_provenance(REPO_ROOT, "this tree")["commit"] == subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
