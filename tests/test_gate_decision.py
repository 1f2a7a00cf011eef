"""The parity gate's decision, pinned statistic by statistic: each comparison the gate makes (harness.parity.gate) gets
synthetic position statistics just over and just under its limit, built so that any other statistic or limit in its
place decides the other way in one of the two (a KL where the largest log-prob error belongs, a median or a maximum
where a 99th percentile belongs, tol where the near-tie tolerance belongs)."""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest

from harness import golden as G
from harness.compare import PositionStat
from harness.parity import gate
from harness.parity.paths import PATHS

N, T, K = 4, 4, 8  # prompt tokens, continuation tokens, the golden's top-K
LAST = N + T - 2  # the last compared position; N - 1 is decode step 0, the prefill's last position
BATCH = next(p for p in PATHS if p.name == "batch")  # teacher-forced
FREE = next(p for p in PATHS if p.name == "free")  # free-running
OVER, UNDER = 1.01, 0.99
TOL = 1e-3


# HF's distance to float64 when a test does not set it: nothing, so that the kernel spread decides. The goldens here
# record HF's runs per setting (hf_variants), so their spread is already what agrees with float64 (harness.hf_referee)
NO_DISTANCE = {k: 0.0 for k in gate.SPREAD_KEYS}


def golden(prompts: int = 1, **provenance) -> G.GoldenSet:
    """Every row's top-K is tokens 0..K-1 at log-probabilities -0.1, -1.1, ...; the greedy continuation is token 0."""
    ids = np.arange(K, dtype=np.int32)
    lp = -0.1 - np.arange(K, dtype=np.float32)
    provenance = dict(dict(hf_reference=NO_DISTANCE, hf_reference_routed=NO_DISTANCE, hf_variants=["eager"], model="m",
                           device_type="cpu"), **provenance)
    return G.GoldenSet([G.PromptGolden(f"p{i}", np.arange(N, dtype=np.int32) + 100, np.zeros(T, dtype=np.int32),
                                       np.tile(ids, (N, 1)), np.tile(lp, (N, 1)), np.tile(ids, (T, 1)),
                                       np.tile(lp, (T, 1))) for i in range(prompts)], provenance)


def stat(err: float = 0.0, kl: float = 0.0, argmax: int = 0) -> PositionStat:
    return PositionStat(err, kl, 0.0, argmax, np.arange(K), -0.1 - np.arange(K, dtype=np.float32))


def stats(prompts: int = 1, **at: PositionStat) -> Dict[int, Dict[int, PositionStat]]:
    """Every position of every prompt a perfect match, except prompt 0's positions named p<pos>."""
    out = {uid: {pos: stat() for pos in range(LAST + 1)} for uid in range(prompts)}
    out[0].update({int(k[1:]): v for k, v in at.items()})
    return out


def evaluate(s, gs=None, path=BATCH, outputs=None, **kw):
    gs = gs or golden(len(s))
    outputs = outputs or [[0] * T for _ in s]
    return gate.evaluate(path, gs, s, outputs, kw.pop("tol", TOL), **kw)


# ------------------------------------------------------------------ the largest log-prob error against tol
@pytest.mark.parametrize("pos", [1, N - 1, LAST], ids=["prefill", "decode step 0", "last decode step"])
def test_a_prompt_fails_when_its_largest_logprob_error_is_just_over_tol(pos):
    # a small KL, and at another position an error just under tol: neither decides
    prompts, _ = evaluate(stats(**{f"p{pos}": stat(err=TOL * OVER, kl=1e-9), "p0": stat(err=TOL * UNDER)}))
    assert not prompts[0].passed and prompts[0].reason.startswith("logprob error")
    assert prompts[0].failure.position == pos


def test_a_prompt_passes_with_its_largest_logprob_error_just_under_tol_however_large_its_kl():
    s = stats(**{f"p{pos}": stat(err=TOL * UNDER, kl=100 * TOL) for pos in range(LAST + 1)})
    prompts, _ = evaluate(s)
    assert prompts[0].passed, prompts[0].reason


def test_the_failure_is_the_first_position_over_tol_and_the_worst_is_the_largest():
    prompts, _ = evaluate(stats(p2=stat(err=TOL * OVER), p5=stat(err=10 * TOL)))
    assert (prompts[0].failure.position, prompts[0].worst.position) == (2, 5)


def test_tol_is_spread_factor_times_hf_largest_error_or_the_floor():
    spread = {"err_max": 1e-3, "err_p99": 1e-4, "err_p90": 1e-5, "err_p50": 1e-6, "kl_max": 1e-2, "kl_mean": 1e-7,
              "kl_p99": 1e-6}
    gs = golden(hf_spread=spread)
    assert gate.tolerance(gs, "float32") == pytest.approx(gate.SPREAD_FACTOR * 1e-3)
    tiny = golden(hf_spread=dict(spread, err_max=1e-9))
    assert gate.tolerance(tiny, "float32") == gate.FLOOR["float32"]
    # the tolerance evaluate is given decides, just over and just under it
    tol = gate.tolerance(gs, "float32")
    assert not evaluate(stats(p3=stat(err=tol * OVER)), gs, tol=tol)[0][0].passed
    assert evaluate(stats(p3=stat(err=tol * UNDER)), gs, tol=tol)[0][0].passed


def test_tol_follows_hf_distance_to_float64_where_it_is_larger_than_its_kernel_spread():
    spread = {"err_max": 1e-4, "err_p99": 1e-5}
    far = dict(NO_DISTANCE, err_max=3e-3, err_p99=1e-3)
    assert gate.tolerance(golden(hf_spread=spread, hf_reference=far), "float32") == pytest.approx(
        gate.SPREAD_FACTOR * 3e-3)
    near = dict(NO_DISTANCE, err_max=5e-5)
    assert gate.tolerance(golden(hf_spread=spread, hf_reference=near), "float32") == pytest.approx(
        gate.SPREAD_FACTOR * 1e-4)


def test_the_half_precision_limits_take_each_statistic_from_the_larger_measure():
    spread = dict(NO_DISTANCE, err_p99=1e-2, kl_mean=1e-3, kl_p99=1e-4)
    ref = dict(NO_DISTANCE, err_p99=5e-3, kl_mean=2e-3, kl_p99=2e-4)
    lim = gate.dist_limits(golden(hf_spread=spread, hf_reference=ref), "bfloat16")
    assert lim == pytest.approx({"err_p99": gate.SOURCES ** 0.5 * 1e-2, "kl_mean": gate.SOURCES * 2e-3,
                                 "kl_p99": gate.SOURCES * 2e-4})


def test_a_golden_without_its_float64_distance_is_refused_with_the_command_that_adds_it():
    gs = golden(hf_spread={"err_max": 1e-4})
    del gs.provenance["hf_reference"]
    gs.reference_command = "python -m harness golden --add-reference --model m --device cpu --dtype float32"
    with pytest.raises(G.GoldenError, match="no distance of HF to float64 .*add it with: python -m harness golden "
                                            "--add-reference --model m"):
        gate.tolerance(gs, "float32")


def test_a_moe_model_in_half_precision_takes_tol_from_hf_spread_away_from_router_near_ties():
    every = {"err_max": 1.0, "err_p99": 0.5, "kl_mean": 0.1, "kl_p99": 0.2}
    routed = {"err_max": 0.01, "err_p99": 0.004, "kl_mean": 1e-4, "kl_p99": 2e-4, "positions": 90,
              "near_tie_positions": 10}
    gs = golden(hf_spread=every, hf_spread_routed=routed)
    assert gate.tolerance(gs, "bfloat16", moe=True) == pytest.approx(gate.SPREAD_FACTOR * 0.01)
    assert gate.tolerance(gs, "bfloat16", moe=False) == pytest.approx(gate.SPREAD_FACTOR * 1.0)


@pytest.mark.parametrize("pos", [1, LAST])
def test_positions_the_engine_did_not_produce_fail_the_prompt(pos):
    s = stats()
    del s[0][pos]
    prompts, _ = evaluate(s)
    assert not prompts[0].passed and prompts[0].reason == f"only {LAST} of {LAST + 1} positions were produced"


# ------------------------------------------------------------------ the half-precision distribution gate
HF = {"err_p50": 1e-4, "err_p90": 1e-3, "err_p99": 1e-2, "err_max": 0.2, "kl_mean": 3e-4, "kl_p99": 1e-3,
      "kl_max": 0.5, "positions": 1000}


def limits() -> Dict[str, float]:
    return gate.dist_limits(golden(hf_spread=HF), "bfloat16")


def test_the_limits_are_the_sources_scaled_hf_percentiles():
    assert limits() == pytest.approx({"err_p99": gate.SOURCES ** 0.5 * 1e-2, "kl_mean": gate.SOURCES * 3e-4,
                                      "kl_p99": gate.SOURCES * 1e-3})
    assert gate.dist_limits(golden(hf_spread=HF), "float32") is None


def test_the_limits_have_floors_for_an_hf_spread_of_zero():
    zero = dict(HF, err_p99=0.0, kl_mean=0.0, kl_p99=0.0)
    assert gate.dist_limits(golden(hf_spread=zero), "bfloat16") == {
        "err_p99": gate.FLOOR["bfloat16"], "kl_mean": gate.KL_FLOOR["bfloat16"], "kl_p99": gate.KL_FLOOR["bfloat16"]}


def p99_at(value: float, n: int = 1000) -> List[float]:
    """n values whose 99th percentile is `value` and whose median, 90th percentile and mean are well under it and
    whose maximum is 100 x over it."""
    xs = [value * 1e-3] * 900 + [value] * (n - 901) + [100 * value]
    assert np.quantile(xs, 0.99) == pytest.approx(value) and np.quantile(xs, 0.9) < value / 5
    assert np.mean(xs) < value / 2
    return xs


def mean_at(value: float, n: int = 1000) -> List[float]:
    """n values of mean `value` whose median is 0 and whose 99th percentile is 2.5 x `value`."""
    return [0.0] * (n * 6 // 10) + [2.5 * value] * (n * 4 // 10)


def _quiet(n: int = 1000) -> List[float]:
    return [1e-9] * n


@pytest.mark.parametrize("key", gate.GATED)
def test_each_distribution_statistic_fails_the_path_just_over_its_limit_and_passes_just_under(key):
    lim = limits()
    for factor, passes in ((OVER, False), (UNDER, True)):
        errs = p99_at(lim["err_p99"] * factor) if key == "err_p99" else _quiet()
        kls = (p99_at(lim["kl_p99"] * factor) if key == "kl_p99" else
               mean_at(lim["kl_mean"] * factor) if key == "kl_mean" else _quiet())
        res = gate.check_path("batch", errs, kls, lim)
        assert res.passed == passes, (key, factor, res.stats, res.reason)
        assert passes or res.reason.startswith(f"{key} ")


def test_kl_p99_is_the_99th_percentile_not_the_mean():
    # a KL mean just under its limit, a 99th percentile over its own: kl_p99 decides
    lim = limits()
    kls = [0.0] * 980 + [lim["kl_p99"] * OVER] * 20
    assert np.mean(kls) < lim["kl_mean"]
    res = gate.check_path("batch", _quiet(), kls, lim)
    assert not res.passed and res.reason.startswith("kl_p99 ")


def test_the_near_tie_share_limit_bounds_the_router_near_ties_left_out():
    routed = dict(HF, positions=900, near_tie_positions=100)  # HF's share: 10%
    lim = gate.dist_limits(golden(hf_spread_routed=routed), "bfloat16", moe=True)
    assert lim["near_tie_share"] == pytest.approx(gate.NEAR_TIE_SHARE * 0.1)
    share = lim["near_tie_share"]
    for factor, passes in ((OVER, False), (UNDER, True)):
        left = round(1000 * share * factor)
        res = gate.check_path("batch", _quiet(1000 - left), _quiet(1000 - left), lim, left_out=left)
        assert res.passed == passes, (factor, res.reason)


def test_the_distribution_gate_takes_the_positions_evaluate_compares():
    # every position of two prompts just over the err_p99 limit: the path fails; its prompts pass their tol
    lim = limits()
    err = lim["err_p99"] * OVER
    s = {uid: {pos: stat(err=err) for pos in range(LAST + 1)} for uid in range(2)}
    prompts, path = evaluate(s, tol=10 * err, limits=lim, tie_tol=gate.tie_tolerance(10 * err, lim))
    assert all(p.passed for p in prompts) and not path.passed and path.stats["err_p99"] == pytest.approx(err)
    assert path.positions == 2 * (LAST + 1)


# ------------------------------------------------------------------ greedy divergence and the near-tie tolerance
def divergent(gap: float, step: int = 1) -> tuple:
    """The engine's argmax is token 1 at decode step `step`; the golden's log-probability gap between its token 0 and
    token 1 there is `gap`."""
    gs = golden()
    gs.prompts[0].decode_lp[step, 1] = gs.prompts[0].decode_lp[step, 0] - gap
    return gs, stats(**{f"p{N - 1 + step}": stat(argmax=1)})


def test_tie_tolerance_is_twice_tol_in_fp32_and_twice_the_err_p99_limit_in_half_precision():
    assert gate.tie_tolerance(TOL, None) == 2 * TOL
    assert gate.tie_tolerance(TOL, limits()) == 2 * limits()["err_p99"]


@pytest.mark.parametrize("tie_tol", [2 * TOL, 7 * TOL], ids=["fp32", "half"])
def test_a_divergence_passes_as_a_near_tie_just_under_the_tie_tolerance_and_fails_just_over(tie_tol):
    for factor, passes in ((OVER, False), (UNDER, True)):
        gs, s = divergent(tie_tol * factor)
        prompts, _ = evaluate(s, gs, tie_tol=tie_tol)
        assert prompts[0].passed == passes, (factor, prompts[0].reason, prompts[0].divergence)
        assert prompts[0].divergence["step"] == 1 and prompts[0].divergence["near_tie"] == passes
        if not passes:
            assert prompts[0].reason == "token differs at step 1 and it is not a near tie"
            assert prompts[0].failure.position == N


def test_a_divergence_to_a_token_outside_the_golden_top_k_fails():
    prompts, _ = evaluate(stats(p4=stat(argmax=K + 5)), tie_tol=1e9)
    assert not prompts[0].passed and prompts[0].divergence["golden_logprob_gap"] is None


def test_free_running_positions_after_a_divergence_are_not_compared():
    # the engine's own token at step 1 differs (a near tie); what follows sees other inputs and may differ freely
    gs, s = divergent(0.5 * TOL)
    s[0][N - 1 + 1] = stat()  # free-running: the sampled token, not the argmax, says what the engine chose
    for pos in range(N + 1, LAST + 1):
        s[0][pos] = stat(err=100 * TOL)
    outputs = [[0, 1] + [0] * (T - 2)]
    prompts, _ = evaluate(s, gs, path=FREE, outputs=outputs)
    assert prompts[0].passed and prompts[0].compared_positions == N + 1, prompts[0].reason
    # teacher-forced, the same errors are compared and fail
    assert not evaluate(s, gs, path=BATCH)[0][0].passed


def test_a_free_running_divergence_that_is_not_a_near_tie_fails():
    gs, s = divergent(10 * TOL)
    prompts, _ = evaluate(s, gs, path=FREE, outputs=[[0, 1] + [0] * (T - 2)])
    assert not prompts[0].passed and prompts[0].reason.startswith("token differs at step 1")


# ------------------------------------------------------------------ router near ties (mixture-of-experts models)
ROUTER_TIE = 1e-5


def margins(value: float, pos: int = 2) -> Dict[int, Dict[int, float]]:
    """Every position's smallest router margin far from a tie, position `pos`'s `value`."""
    m = {p: 1.0 for p in range(LAST + 1)}
    m[pos] = value
    return {0: m}


@pytest.mark.parametrize("factor,excused", [(UNDER, True), (1.0, True), (OVER, False)])
def test_a_router_margin_at_most_the_router_tie_excuses_its_position(factor, excused):
    s = stats(p2=stat(err=100 * TOL))
    prompts, _ = evaluate(s, margins=margins(ROUTER_TIE * factor), router_tie=ROUTER_TIE)
    assert prompts[0].passed == excused, prompts[0].reason
    assert (prompts[0].router_near_ties, prompts[0].router_excused) == ((1, 1) if excused else (0, 0))


def test_a_router_near_tie_excuses_a_divergence_at_its_position():
    gs, s = divergent(100 * TOL)
    prompts, _ = evaluate(s, gs, margins=margins(ROUTER_TIE * UNDER, pos=N), router_tie=ROUTER_TIE)
    assert prompts[0].passed and prompts[0].divergence["router_near_tie"]
    prompts, _ = evaluate(s, gs, margins=margins(ROUTER_TIE * OVER, pos=N), router_tie=ROUTER_TIE)
    assert not prompts[0].passed


def test_the_golden_router_near_ties_excuse_their_positions_too():
    gs = golden(hf_router_near_ties={"p0": [2]})
    s = stats(p2=stat(err=100 * TOL))
    assert evaluate(s, gs, margins=margins(1.0), router_tie=ROUTER_TIE)[0][0].passed
    # a dense model (no margins) has no router near ties, whatever the provenance says
    assert not evaluate(s, gs)[0][0].passed


def test_half_precision_leaves_router_near_ties_out_of_the_distribution():
    lim = dict(limits(), near_tie_share=1.0)
    s = stats(p2=stat(err=100 * TOL, kl=100 * TOL))
    _, path = evaluate(s, margins=margins(ROUTER_TIE * UNDER), router_tie=ROUTER_TIE, limits=lim)
    assert path.left_out == 1 and path.positions == LAST and path.stats["err_max"] == 0.0
    _, path = evaluate(s, margins=margins(ROUTER_TIE * OVER), router_tie=ROUTER_TIE, limits=lim)
    assert path.left_out == 0 and path.positions == LAST + 1 and path.stats["err_max"] == 100 * TOL
