"""The first failure of a parity run, shown: its headline names the path, prompt and position (prefill or decode
step) of whichever comparison failed first, and its block says what failed beside its tolerance."""

from __future__ import annotations

import pytest
from test_gate_decision import LAST, N, TOL, divergent, evaluate, limits, stat, stats

from harness import golden as G
from harness import zoo
from harness.compare import PositionStat
from harness.parity import gate
from harness.parity.paths import PATHS
from harness.parity.failure import failure_block, first_failure, headline


def result(prompts, path, dtype: str = "float32") -> gate.ParityResult:
    r = gate.ParityResult("tiny-qwen3", "cpu", dtype, TOL, TOL / 4, 2 * TOL)
    r.prompts, r.paths = prompts, [path]
    return r


def test_a_pass_has_no_first_failure():
    assert headline(result(*evaluate(stats()))) is None


def test_a_logprob_error_is_shown_at_its_first_position_over_tol():
    r = result(*evaluate(stats(p1=stat(err=2 * TOL), p5=stat(err=9 * TOL))))
    assert headline(r) == ("first failure: model tiny-qwen3, dtype float32, path batch, prompt 0, position 1 "
                           "(prefill)")
    assert first_failure(r).statistic.startswith(f"largest logprob err {9 * TOL:.3g} (at position 5) vs tol")


def test_a_divergence_is_shown_at_its_decode_step():
    gs, s = divergent(10 * TOL, step=2)
    r = result(*evaluate(s, gs))
    assert headline(r).endswith(f"prompt 0, position {N + 1} (decode step 2)")
    assert first_failure(r).statistic.startswith("greedy divergence at decode step 2: golden token 0 vs engine 1")


def test_the_prompt_is_named_by_its_index_in_the_golden():
    s = stats(2, p3=stat(err=2 * TOL))
    prompts, path = evaluate({0: s[1], 1: s[0]}, indices=[4, 7])
    assert headline(result(prompts, path)).endswith(f"prompt 7, position {N - 1} (decode step 0)")


def test_a_missing_position_is_shown_where_it_is_missing():
    s = stats()
    del s[0][2]
    assert headline(result(*evaluate(s))).endswith("prompt 0, position 2 (prefill)")


@pytest.mark.parametrize("key,at", [("err_p99", 4), ("kl_mean", 5)])
def test_a_distribution_failure_is_shown_at_its_largest_error_or_kl(key, at):
    lim = limits()
    over = {"err_p99": stat(err=2 * lim["err_p99"]), "kl_mean": stat(kl=100 * lim["kl_mean"])}[key]
    s = {uid: {pos: stat() for pos in range(LAST + 1)} for uid in range(2)}
    s[1] = {pos: over for pos in range(LAST + 1)}
    s[1][at] = stat(err=over.err * 1.5, kl=over.kl * 1.5)
    prompts, path = evaluate(s, tol=1.0, limits=lim)
    r = result(prompts, path, "bfloat16")
    assert all(p.passed for p in prompts) and not path.passed
    assert headline(r).endswith(f"path batch, prompt 1, position {at} (decode step {at - N + 1})")
    assert first_failure(r).statistic.startswith(f"distribution gate over {2 * (LAST + 1)} positions: {key} ")


def _failed_at_decode_step_2() -> tuple:
    """A run whose prompt 3 fails at decode step 2 (its golden, the tokenizer, the prompt's prefill length)."""
    from transformers import AutoTokenizer

    gs = G.load_checked("tiny-qwen3", "cpu", "float32")
    s = {}
    for uid, p in enumerate(gs.prompts):  # every position a match: the argmax is the golden's token
        n = len(p.prompt_ids)
        s[uid] = {pos: stat(argmax=int(p.tokens[pos - n + 1]) if pos >= n - 1 else 0)
                  for pos in range(n + len(p.tokens) - 1)}
    pg = gs.prompts[3]
    n = len(pg.prompt_ids)
    s[3][n + 1] = PositionStat(2 * TOL, 0.0, 0.0, int(pg.tokens[2]), pg.decode_ids[2], pg.decode_lp[2])
    r = result(*gate.evaluate(PATHS[0], gs, s, [], TOL))
    return r, gs, AutoTokenizer.from_pretrained(zoo.path("tiny-qwen3")), n


def test_the_block_decodes_the_text_and_both_top_5_and_gives_the_rerun_command():
    r, gs, tok, n = _failed_at_decode_step_2()
    pg = gs.prompts[3]
    block = failure_block(r, gs, tok).splitlines()
    assert block[0] == headline(r) and headline(r).endswith(f"prompt 3, position {n + 1} (decode step 2)")
    shown = block[1].split("predicted there: ", 1)[1]
    assert shown == repr(tok.decode([int(t) for t in pg.prompt_ids[-22:]] + [int(t) for t in pg.tokens[:2]]))
    top = "  ".join(f"{tok.decode([int(i)])!r} {lp:.4g}" for i, lp in zip(pg.decode_ids[2][:5], pg.decode_lp[2][:5]))
    assert block[2] == f"  golden top-5: {top}" and block[3] == f"  engine top-5: {top}"
    assert block[5] == ("  re-run this path, judging only this prompt (run in the same company): python -m harness "
                        "parity --model tiny-qwen3 --device cpu --dtype float32 --path batch --prompt 3")
    assert block[6].startswith("  why: the same command with --explain")


def test_the_block_offers_explain_only_where_it_can_run():
    """--explain hooks this engine's layers, and refuses another engine: a black box's block does not offer it."""
    r, gs, tok, _ = _failed_at_decode_step_2()
    r.engine = "openai:http://127.0.0.1:8000"
    block = failure_block(r, gs, tok)
    assert "--explain" not in block
    assert block.splitlines()[-1].endswith("--prompt 3 --engine openai:http://127.0.0.1:8000")


def test_a_re_run_of_one_prompt_judges_it_in_the_company_it_was_judged_in():
    """--prompt I runs the path's whole set and judges only prompt I: its statistics are bitwise the full run's (alone
    in its batch it would have other GEMM shapes, and rounding, than in the run that failed)."""
    from harness.parity.run import run_parity

    full = run_parity("tiny-qwen3", paths=["batch"])
    alone = run_parity("tiny-qwen3", paths=["batch"], prompt="2")
    assert [p.index for p in alone.prompts] == [2]
    ours, theirs = alone.prompts[0], full.prompts[2]
    assert (ours.max_err_prefill, ours.max_err_decode, ours.max_kl) == (
        theirs.max_err_prefill, theirs.max_err_decode, theirs.max_kl)
