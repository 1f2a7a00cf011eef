"""Parity: the engine against the golden files, along every path the engine has.

The measure, per position: err = max |engine - golden| log-probability on the golden's top-K ids, and KL(golden ||
engine) on those ids plus one "rest" bucket (a lower bound of the full KL). HF's own spread (own_spread), statistic
by statistic, is the larger of two measures recorded in the golden's provenance, each with the same measure on the
golden's sequences: HF against itself (sdpa against eager attention and other thread counts: one kernel's rounding),
and HF against HF in float64 (harness.golden_reference: the rounding every op of the model carries in the golden's
dtype, which grows with the model's activations, depth and prompt length where the first does not).

HF's own bugs are findings, never tolerances (harness.hf_referee): a setting of HF's that float64 shows off at a
position is left out of both measures there, and a position where the golden's own row is off is not judged (its row
is not HF's answer); the parity report names them.

Every dtype: max err over a prompt <= tol = max(SPREAD_FACTOR x HF's largest err, FLOOR[dtype]). Against the float64
result x, |engine - golden| <= |engine - x| + |golden - x|: SPREAD_FACTOR = 4 admits an engine whose own rounding is up
to 3x HF's. A real bug (a rotary off by one, a wrong KV head) moves log-probabilities by 1e-1 or more.

Half precision adds a distribution gate, per path over every compared position: the engine's mean and
99th-percentile KL within SOURCES x HF's, its 99th-percentile err within sqrt(SOURCES) x HF's (each with a floor).
The engine may differ from HF through SOURCES = 3 independent sources, each about as large as HF's own attention
switch: its attention kernel, its fused ops' roundings, its merged GEMMs' accumulation order. Independent
perturbations add in variance, so KL (quadratic in the logit perturbation) may grow SOURCES-fold and err (linear)
sqrt(SOURCES)-fold. In bf16 HF's largest err is a tail token's (a logprob of -20 moves by a few nats), so the max
alone admits bugs that shift every position a little; the percentiles and the mean do not.

Near-tie rule: when the engine's argmax differs from the golden token, the divergence passes only if the golden's
log-probability gap between the two tokens is <= tie_tol: 2 x tol in fp32 (both log-probabilities may move by tol),
2 x sqrt(SOURCES) x HF's 99th-percentile err in half precision. Anything else fails.

Router near ties (mixture-of-experts models): a token whose k-th and (k+1)-th router logits differ by at most
ROUTER_TIE[dtype] x the row's largest |logit| (in any MoE layer, engine.moe.router_margin) may choose the other
expert than HF where both round differently, and that moves its own logits by far more than the tolerance. A
position is a router near tie where the engine's margin or the golden's (HF sdpa's, recorded in the golden's
provenance) is one: counted and reported per prompt and per path; its err may exceed tol and its token may diverge
(like a near-tie token). In half precision, where about a fifth of positions are near ties, the distribution gate
and tol leave them out and take their limits from HF's spread over the positions where neither of HF's runs is a
near tie (hf_spread_routed): which near ties two correct kernels flip is luck, and over all positions the few
flipped ones set the 99th percentile. The near ties left out may be at most NEAR_TIE_SHARE x HF's share of them, so
that margins gone wrong (every position a near tie) cannot empty the gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

import numpy as np

from harness import golden_files as G
from harness import hf_referee, subjects
from harness.compare import PositionStat
from harness.hf_runs import spread_summary
from harness.parity.paths import ParityPath

SPREAD_FACTOR = 4.0
SOURCES = 3  # independent sources of difference from HF the half-precision gate allows, each HF's own size
DIST_FACTOR = {"err_p99": SOURCES ** 0.5, "kl_mean": float(SOURCES), "kl_p99": float(SOURCES)}
FLOOR = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
KL_FLOOR = {"bfloat16": 1e-5, "float16": 1e-6}  # the distribution gate's floor for HF spreads of ~0
HALF = ("bfloat16", "float16")
NEAR_TIE_SHARE = 2.0  # the largest share of router near ties left out, as a multiple of HF's share


@dataclass
class Where:
    """A compared position and both sides' top tokens there: where a failure is shown."""

    prompt: int  # the prompt's index in the golden
    position: int  # absolute position whose distribution predicts the next token
    step: int | None  # the decode step whose distribution it is (0: the prefill's last position); None: prefill
    value: float  # the statistic there (err, or KL for the distribution gate's KL limits)
    golden_top: List[List[float]]  # [[token id, logprob], ...] the golden's top TOP_SHOWN
    engine_top: List[List[float]]  # and the engine's (both empty where the engine produced no logits)


TOP_SHOWN = 5


def where(pg: G.PromptGolden, index: int, pos: int, stat: PositionStat, value: float) -> Where:
    ids, lp = golden_row(pg, pos)
    step = pos - len(pg.prompt_ids) + 1

    def top(i: np.ndarray, v: np.ndarray) -> List[List[float]]:
        return [[int(a), float(b)] for a, b in zip(i[:TOP_SHOWN], v[:TOP_SHOWN])]

    return Where(index, pos, step if step >= 0 else None, float(value), top(ids, lp), top(stat.top_ids, stat.top_lp))


@dataclass
class PromptResult:
    path: str
    prompt: str
    index: int = 0  # the prompt's index in the golden
    max_err_prefill: float = 0.0
    max_err_decode: float = 0.0
    max_kl: float = 0.0
    max_tv: float = 0.0
    compared_positions: int = 0
    divergence: Dict[str, Any] | None = None  # first position where the tokens differ
    passed: bool = True
    reason: str = ""
    router_near_ties: int = 0  # compared positions whose routing is a near tie (MoE)
    router_excused: int = 0  # of those, positions whose err exceeds tol
    hf_off: int = 0  # compared positions where the golden's own row is off (float64 says so): not judged
    failure: Where | None = None  # the position that failed the prompt: the first err over tol, or the divergence
    worst: Where | None = None  # the largest err outside router near ties


@dataclass
class PathResult:
    """A path's error distribution against the half-precision gate's limits (None: the gate does not apply)."""

    path: str
    positions: int
    stats: Dict[str, float]  # err_p50, err_p90, err_p99, kl_mean, kl_p99 of the engine
    limits: Dict[str, float] | None
    passed: bool = True
    reason: str = ""
    router_near_ties: int = 0
    router_excused: int = 0
    left_out: int = 0  # router near ties left out of the distribution (MoE in half precision)
    worst_err: Where | None = None  # the gated positions' largest err
    worst_kl: Where | None = None  # and largest KL
    seconds: float = 0.0  # the path's engine run and comparison


@dataclass
class ParityResult:
    model: str
    device: str
    dtype: str
    tol: float
    hf_spread: float
    tie_tol: float = 0.0
    hf_stats: Dict[str, Any] | None = None  # HF's own spread distribution (from the golden's provenance)
    prompts: List[PromptResult] = field(default_factory=list)
    paths: List[PathResult] = field(default_factory=list)
    obtained: str = ""  # where the engine's result was written when parity failed
    failure: str = ""  # the first failure, shown (harness.parity.failure.failure_block)
    model_args: str = ""  # how a command line names the model and its goldens (--model NAME, --model-path DIR ...)
    tp: int = 1
    router_tie: float | None = None  # the router near-tie margin (MoE models only)
    batch_invariant: bool = False  # the engines ran in batch-invariant mode
    engine: str = subjects.OWN  # the engine under test (--engine, harness.subjects)
    engine_info: Dict[str, Any] | None = None  # a black box's own provenance (its kind, version)
    top_k: int | None = None  # the log-probabilities per position a black box returns (harness.compare.compare_topk)
    nondeterministic: str = ""  # the failing path run again in a fresh process gave other bits (harness.parity.rerun)
    hf_findings: List[str] = field(default_factory=list)  # what float64 refutes of HF's own runs (hf_referee)

    @property
    def mode_suffix(self) -> str:
        """What the mode and another engine add to the report's and the obtained file's folder name."""
        return ("-batch-invariant" if self.batch_invariant else "") + subjects.suffix(self.engine)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.prompts) and all(p.passed for p in self.paths)


def spread_stats(gs: G.GoldenSet, dtype: str, moe: bool = False) -> Dict[str, Any] | None:
    """HF's spread distribution the half-precision gate and tol scale: over every position, or for a MoE model in
    half precision over the positions away from router near ties (hf_spread_routed)."""
    key = "hf_spread_routed" if moe and dtype in HALF else "hf_spread"
    stats = gs.provenance.get(key)
    if not stats and dtype in HALF:
        what = "away from router near ties " if key == "hf_spread_routed" else ""
        raise G.GoldenError(f"the {dtype} golden has no HF spread distribution {what}in its provenance; measure it "
                            f"with: python -m harness golden --refresh-spread --model {gs.provenance['model']} "
                            f"--device {gs.provenance['device_type']} --dtype {dtype}")
    return stats


def reference_stats(gs: G.GoldenSet, dtype: str, moe: bool = False) -> Dict[str, Any] | None:
    """HF's distance to float64 (over every position, or for a MoE model in half precision away from router near
    ties); None where it could not be measured (hf_reference_unmeasured says why); a golden made before it was
    recorded is refused with the command that adds it."""
    if gs.provenance.get("hf_reference_unmeasured"):
        return None
    key = "hf_reference_routed" if moe and dtype in HALF else "hf_reference"
    stats = gs.provenance.get(key)
    if not stats:
        command = gs.reference_command or G.reference_command(gs.provenance["model"], gs.provenance["device_type"],
                                                              dtype)
        raise G.GoldenError(f"the {gs.provenance['model']} {gs.provenance['device_type']} {dtype} golden records no "
                            f"distance of HF to float64 arithmetic, which the parity tolerance follows; add it with: "
                            f"{command}")
    return stats


SPREAD_KEYS = ("err_p50", "err_p90", "err_p99", "err_max", "err_mean", "kl_p50", "kl_p90", "kl_p99", "kl_mean",
               "kl_max")


def own_spread(gs: G.GoldenSet, dtype: str, moe: bool = False) -> Dict[str, Any]:
    """HF's own spread, statistic by statistic the larger of its kernel spread (spread_stats; older goldens record
    only its largest err) and its distance to float64 (reference_stats). kernel_* and float64_* keep both. A kernel
    spread that float64 refutes as a whole (a golden without per-setting records, hf_referee.refuted_summary) is left
    out, and kernel_refuted says why."""
    spread = spread_stats(gs, dtype, moe) or {"err_max": float(gs.provenance["hf_spread_max_abs_logprob"])}
    ref = reference_stats(gs, dtype, moe)
    refuted = hf_referee.refuted_summary(gs.provenance, spread, ref)
    if refuted:
        return dict(ref, kernel_refuted=refuted, float64_err_max=ref["err_max"], float64_err_p99=ref["err_p99"])
    own = dict(spread)
    own.update({f"kernel_{k}": spread[k] for k in ("err_max", "err_p99") if k in spread})
    if ref is None:
        own["float64_unmeasured"] = gs.provenance["hf_reference_unmeasured"]
        return own
    for k in SPREAD_KEYS:
        if k in ref:
            own[k] = max(float(spread.get(k, 0.0)), float(ref[k]))
    if "positions" in ref:  # an older golden's spread is its largest err only
        own.setdefault("positions", ref["positions"])
    own.update({f"float64_{k}": ref[k] for k in ("err_max", "err_p99")})
    return own


def hf_largest_err(gs: G.GoldenSet, dtype: str, moe: bool = False) -> float:
    """HF's largest err over the positions tol applies to."""
    return own_spread(gs, dtype, moe)["err_max"]


def tolerance(gs: G.GoldenSet, dtype: str, moe: bool = False) -> float:
    return max(SPREAD_FACTOR * hf_largest_err(gs, dtype, moe), FLOOR[dtype])


GATED = ("err_p99", "kl_mean", "kl_p99")  # what the half-precision distribution gate bounds


def dist_limits(gs: G.GoldenSet, dtype: str, moe: bool = False) -> Dict[str, float] | None:
    """The half-precision gate's limits from HF's spread distribution; None in fp32. A MoE model's add
    near_tie_share: the largest share of positions its router near ties may leave out."""
    if dtype not in HALF:
        return None
    stats = own_spread(gs, dtype, moe)
    floors = {"err_p99": FLOOR[dtype], "kl_mean": KL_FLOOR[dtype], "kl_p99": KL_FLOOR[dtype]}
    limits = {k: max(DIST_FACTOR[k] * stats[k], floors[k]) for k in GATED}
    if moe:  # HF's share of near ties among its own runs (the kernel spread's)
        hf_share = stats["near_tie_positions"] / (stats["near_tie_positions"] + stats["positions"])
        limits["near_tie_share"] = min(NEAR_TIE_SHARE * hf_share, 1.0)
    return limits


def tie_tolerance(tol: float, limits: Dict[str, float] | None) -> float:
    """Twice what one log-probability may move: tol, or in half precision the gate's 99th-percentile err limit."""
    return 2 * (tol if limits is None else limits["err_p99"])


def path_stats(errs: List[float], kls: List[float]) -> Dict[str, float]:
    summary = spread_summary(errs, kls)
    return {k: summary[k] for k in ("err_p50", "err_p90", "err_p99", "err_max", "kl_mean", "kl_p99")}


def check_path(name: str, errs: List[float], kls: List[float], limits: Dict[str, float] | None,
               left_out: int = 0) -> PathResult:
    """The distribution gate over a path's compared positions; left_out: router near ties not among them."""
    res = PathResult(name, len(errs), path_stats(errs, kls) if errs else {}, limits, left_out=left_out)
    if limits is not None:
        over = [f"{k} {res.stats[k]:.3g} > {limits[k]:.3g}" for k in GATED if errs and res.stats[k] > limits[k]]
        share = left_out / max(left_out + len(errs), 1)
        if "near_tie_share" in limits and share > limits["near_tie_share"]:
            over.append(f"router near ties left out on {share:.0%} of positions > {limits['near_tie_share']:.0%}")
        res.passed, res.reason = not over, "; ".join(over)
    return res


def golden_row(pg: G.PromptGolden, pos: int) -> tuple[np.ndarray, np.ndarray]:
    """The golden's top-K (ids, logprobs) for the distribution predicted at absolute position pos."""
    n = len(pg.prompt_ids)
    return (pg.prefill_ids[pos], pg.prefill_lp[pos]) if pos < n else (pg.decode_ids[pos - n + 1],
                                                                       pg.decode_lp[pos - n + 1])


def _divergence(pg: G.PromptGolden, j: int, engine_tok: int, stat: PositionStat, tie_tol: float,
                router_tie: bool) -> Dict[str, Any]:
    n = len(pg.prompt_ids)
    ids, lp = pg.decode_ids[j], pg.decode_lp[j]
    g = int(pg.tokens[j])
    in_golden = np.nonzero(ids == engine_tok)[0]
    gap = float(lp[ids == g][0] - lp[in_golden[0]]) if len(in_golden) and (ids == g).any() else None
    in_engine = np.nonzero(stat.top_ids == g)[0]
    return {"step": j, "position": n - 1 + j, "golden_token": g, "engine_token": engine_tok,
            "golden_logprob_gap": gap, "near_tie": (gap is not None and abs(gap) <= tie_tol) or router_tie,
            "router_near_tie": router_tie,
            "engine_token_rank_in_golden": int(in_golden[0]) if len(in_golden) else None,
            "golden_token_rank_in_engine": int(in_engine[0]) if len(in_engine) else None}


def evaluate(path: ParityPath, gs: G.GoldenSet, stats: Dict[int, Dict[int, PositionStat]],
             outputs: List[List[int]], tol: float, tie_tol: float | None = None,
             limits: Dict[str, float] | None = None, margins: Dict[int, Dict[int, float]] | None = None,
             router_tie: float = 0.0, indices: List[int] | None = None) -> tuple[List[PromptResult], PathResult]:
    """Per prompt: every position's error against tol, and the first divergence; per path: the distribution gate.
    margins: per prompt and position, the smallest router margin over the MoE layers (None: a dense model); the
    golden's own near ties join the engine's. indices: each prompt's index in the full golden (gs may be a subset)."""
    tie_tol = 2 * tol if tie_tol is None else tie_tol
    golden_ties = gs.provenance.get("hf_router_near_ties", {}) if margins is not None else {}
    golden_off = gs.provenance.get("hf_off", {}).get("golden", {})  # HF's row is off there: not judged
    leave_out = margins is not None and limits is not None  # half precision gates MoE models away from near ties
    results, errs, kls, gated, left_out = [], [], [], [], 0
    for uid, pg in enumerate(gs.prompts):
        index = uid if indices is None else indices[uid]
        res = PromptResult(path.name, pg.name, index)
        ties = {pos for pos, m in (margins or {}).get(uid, {}).items() if m <= router_tie}
        ties |= set(golden_ties.get(pg.name, ()))
        off = set(golden_off.get(pg.name, ()))
        worst, first_over = None, None  # outside router near ties: the largest err, the first err over tol
        n = len(pg.prompt_ids)
        # teacher-forced, the engine's choice is its argmax; a position it did not produce fails below, not here
        tokens = outputs[uid] if not path.forced else [stats[uid][n - 1 + j].argmax if n - 1 + j in stats[uid]
                                                       else int(t) for j, t in enumerate(pg.tokens)]
        div_step = next((j for j, (a, b) in enumerate(zip(tokens, pg.tokens)) if a != int(b)), None)
        # free-running: positions after a divergence see other inputs than the golden's and are not compared
        last = n - 1 + (len(pg.tokens) - 1 if path.forced or div_step is None else div_step)
        for pos, st in sorted(stats[uid].items()):
            if pos > last:
                continue
            res.compared_positions += 1
            if pos in off:
                res.hf_off += 1
                continue
            if leave_out and pos in ties:
                left_out += 1
            else:
                errs.append(st.err)
                kls.append(st.kl)
                gated.append((uid, pos, st))
            if pos < n - 1:
                res.max_err_prefill = max(res.max_err_prefill, st.err)
            else:
                res.max_err_decode = max(res.max_err_decode, st.err)
            res.max_kl, res.max_tv = max(res.max_kl, st.kl), max(res.max_tv, st.tv)
            if pos in ties:
                res.router_near_ties += 1
                res.router_excused += st.err > tol
                continue
            if worst is None or st.err > worst[1].err:
                worst = (pos, st)
            if first_over is None and st.err > tol:
                first_over = (pos, st)
        if worst is not None:
            res.worst = where(pg, index, worst[0], worst[1], worst[1].err)
        if res.compared_positions != last + 1:
            res.passed, res.reason = False, f"only {res.compared_positions} of {last + 1} positions were produced"
            missing = next(pos for pos in range(last + 1) if pos not in stats[uid])
            step = missing - n + 1
            res.failure = Where(index, missing, step if step >= 0 else None, float("nan"), [], [])
        elif first_over is not None:
            res.passed, res.reason = False, f"logprob error {worst[1].err:.3g} > tol"
            res.failure = where(pg, index, first_over[0], first_over[1], first_over[1].err)
        if div_step is not None:
            pos = n - 1 + div_step
            res.divergence = _divergence(pg, div_step, tokens[div_step], stats[uid][pos], tie_tol, pos in ties)
            if pos in off:  # the golden's token there is not HF's answer
                res.divergence["near_tie"] = res.divergence["hf_off"] = True
            if not res.divergence["near_tie"] and res.passed:
                res.passed, res.reason = False, f"token differs at step {div_step} and it is not a near tie"
                res.failure = where(pg, index, pos, stats[uid][pos], stats[uid][pos].err)
        results.append(res)
    path_result = check_path(path.name, errs, kls, limits, left_out)
    if gated:
        for attr, key in (("worst_err", "err"), ("worst_kl", "kl")):
            uid, pos, st = max(gated, key=lambda g: getattr(g[2], key))
            idx = uid if indices is None else indices[uid]
            setattr(path_result, attr, where(gs.prompts[uid], idx, pos, st, getattr(st, key)))
    path_result.router_near_ties = sum(r.router_near_ties for r in results)
    path_result.router_excused = sum(r.router_excused for r in results)
    return results, path_result
