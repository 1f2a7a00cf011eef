"""Parity: the engine against the golden files, along every path the engine has.

The measure, per position: err = max |engine - golden| log-probability on the golden's top-K ids, and KL(golden ||
engine) on those ids plus one "rest" bucket (a lower bound of the full KL). HF's own spread is the same measure
between HF's eager and sdpa attention on the golden's sequences, recorded in the golden's provenance.

Every dtype: max err over a prompt <= tol = max(SPREAD_FACTOR x HF's largest err, FLOOR[dtype]). Two correct
implementations differ by about HF's spread; a real bug (a rotary off by one, a wrong KV head) moves
log-probabilities by 1e-1 or more.

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
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import golden as G
from harness import zoo
from harness.driver import Driver
from harness.parity_paths import PATHS, ParityPath
from harness.parity_report import write_report
from harness.report import add_update_flag

logger = logging.getLogger(__name__)

SPREAD_FACTOR = 4.0
SOURCES = 3  # independent sources of difference from HF the half-precision gate allows, each HF's own size
DIST_FACTOR = {"err_p99": SOURCES ** 0.5, "kl_mean": float(SOURCES), "kl_p99": float(SOURCES)}
FLOOR = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
KL_FLOOR = {"bfloat16": 1e-5, "float16": 1e-6}  # the distribution gate's floor for HF spreads of ~0
HALF = ("bfloat16", "float16")


@dataclass
class PositionStat:
    err: float  # max |engine - golden| logprob on the golden's top-K ids
    kl: float
    tv: float
    argmax: int
    top_ids: np.ndarray  # the engine's top-K ids
    top_lp: np.ndarray  # and their log-probabilities


@dataclass
class PromptResult:
    path: str
    prompt: str
    max_err_prefill: float = 0.0
    max_err_decode: float = 0.0
    max_kl: float = 0.0
    max_tv: float = 0.0
    compared_positions: int = 0
    divergence: Dict[str, Any] | None = None  # first position where the tokens differ
    passed: bool = True
    reason: str = ""


@dataclass
class PathResult:
    """A path's error distribution against the half-precision gate's limits (None: the gate does not apply)."""

    path: str
    positions: int
    stats: Dict[str, float]  # err_p50, err_p90, err_p99, kl_mean, kl_p99 of the engine
    limits: Dict[str, float] | None
    passed: bool = True
    reason: str = ""


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
    tp: int = 1

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.prompts) and all(p.passed for p in self.paths)


def tolerance(gs: G.GoldenSet, dtype: str) -> float:
    return max(SPREAD_FACTOR * gs.provenance["hf_spread_max_abs_logprob"], FLOOR[dtype])


GATED = ("err_p99", "kl_mean", "kl_p99")  # what the half-precision distribution gate bounds


def dist_limits(gs: G.GoldenSet, dtype: str) -> Dict[str, float] | None:
    """The half-precision gate's limits from HF's spread distribution; None in fp32."""
    if dtype not in HALF:
        return None
    stats = gs.provenance.get("hf_spread")
    if not stats:
        raise G.GoldenError(f"the {dtype} golden has no HF spread distribution in its provenance; measure it with: "
                            f"python -m harness golden --refresh-spread --model {gs.provenance['model']} "
                            f"--device {gs.provenance['device_type']} --dtype {dtype}")
    floors = {"err_p99": FLOOR[dtype], "kl_mean": KL_FLOOR[dtype], "kl_p99": KL_FLOOR[dtype]}
    return {k: max(DIST_FACTOR[k] * stats[k], floors[k]) for k in GATED}


def tie_tolerance(tol: float, limits: Dict[str, float] | None) -> float:
    """Twice what one log-probability may move: tol, or in half precision the gate's 99th-percentile err limit."""
    return 2 * (tol if limits is None else limits["err_p99"])


def path_stats(errs: List[float], kls: List[float]) -> Dict[str, float]:
    summary = G.spread_summary(errs, kls)
    return {k: summary[k] for k in ("err_p50", "err_p90", "err_p99", "err_max", "kl_mean", "kl_p99")}


def check_path(name: str, errs: List[float], kls: List[float], limits: Dict[str, float] | None) -> PathResult:
    res = PathResult(name, len(errs), path_stats(errs, kls) if errs else {}, limits)
    if limits is not None and errs:
        over = [f"{k} {res.stats[k]:.3g} > {limits[k]:.3g}" for k in GATED if res.stats[k] > limits[k]]
        res.passed, res.reason = not over, "; ".join(over)
    return res


def golden_row(pg: G.PromptGolden, pos: int) -> tuple[np.ndarray, np.ndarray]:
    """The golden's top-K (ids, logprobs) for the distribution predicted at absolute position pos."""
    n = len(pg.prompt_ids)
    return (pg.prefill_ids[pos], pg.prefill_lp[pos]) if pos < n else (pg.decode_ids[pos - n + 1],
                                                                       pg.decode_lp[pos - n + 1])


def compare_row(engine_lp: torch.Tensor, ids: np.ndarray, ref_lp: np.ndarray) -> PositionStat:
    """engine_lp [vocab] float32 log-probabilities against the golden's top-K row."""
    e = engine_lp[torch.from_numpy(ids.astype(np.int64))].double().numpy()
    r = ref_lp.astype(np.float64)
    p, q = np.exp(r), np.exp(e)
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 0.0)
    kl = float(np.sum(p * (r - e)) + (p_rest * np.log(p_rest / q_rest) if p_rest > 1e-12 and q_rest > 0 else 0.0))
    tv = 0.5 * float(np.abs(p - q).sum() + abs(p_rest - q_rest))
    top = engine_lp.topk(len(ids))
    return PositionStat(float(np.abs(e - r).max()), max(kl, 0.0), tv, int(top.indices[0]), top.indices.numpy(),
                        top.values.numpy())


def _divergence(pg: G.PromptGolden, j: int, engine_tok: int, stat: PositionStat, tie_tol: float) -> Dict[str, Any]:
    n = len(pg.prompt_ids)
    ids, lp = pg.decode_ids[j], pg.decode_lp[j]
    g = int(pg.tokens[j])
    in_golden = np.nonzero(ids == engine_tok)[0]
    gap = float(lp[ids == g][0] - lp[in_golden[0]]) if len(in_golden) and (ids == g).any() else None
    in_engine = np.nonzero(stat.top_ids == g)[0]
    return {"step": j, "position": n - 1 + j, "golden_token": g, "engine_token": engine_tok,
            "golden_logprob_gap": gap, "near_tie": gap is not None and abs(gap) <= tie_tol,
            "engine_token_rank_in_golden": int(in_golden[0]) if len(in_golden) else None,
            "golden_token_rank_in_engine": int(in_engine[0]) if len(in_engine) else None}


def evaluate(path: ParityPath, gs: G.GoldenSet, stats: Dict[int, Dict[int, PositionStat]],
             outputs: List[List[int]], tol: float, tie_tol: float | None = None,
             limits: Dict[str, float] | None = None) -> tuple[List[PromptResult], PathResult]:
    """Per prompt: every position's error against tol, and the first divergence; per path: the distribution gate."""
    tie_tol = 2 * tol if tie_tol is None else tie_tol
    results, errs, kls = [], [], []
    for uid, pg in enumerate(gs.prompts):
        res = PromptResult(path.name, pg.name)
        n = len(pg.prompt_ids)
        tokens = outputs[uid] if not path.forced else [stats[uid][n - 1 + j].argmax for j in range(len(pg.tokens))]
        div_step = next((j for j, (a, b) in enumerate(zip(tokens, pg.tokens)) if a != int(b)), None)
        # free-running: positions after a divergence see other inputs than the golden's and are not compared
        last = n - 1 + (len(pg.tokens) - 1 if path.forced or div_step is None else div_step)
        for pos, st in stats[uid].items():
            if pos > last:
                continue
            res.compared_positions += 1
            errs.append(st.err)
            kls.append(st.kl)
            if pos < n - 1:
                res.max_err_prefill = max(res.max_err_prefill, st.err)
            else:
                res.max_err_decode = max(res.max_err_decode, st.err)
            res.max_kl, res.max_tv = max(res.max_kl, st.kl), max(res.max_tv, st.tv)
        if res.compared_positions != last + 1:
            res.passed, res.reason = False, f"only {res.compared_positions} of {last + 1} positions were produced"
        elif max(res.max_err_prefill, res.max_err_decode) > tol:
            res.passed, res.reason = False, f"logprob error {max(res.max_err_prefill, res.max_err_decode):.3g} > tol"
        if div_step is not None:
            res.divergence = _divergence(pg, div_step, tokens[div_step], stats[uid][n - 1 + div_step], tie_tol)
            if not res.divergence["near_tie"] and res.passed:
                res.passed, res.reason = False, f"token differs at step {div_step} and it is not a near tie"
        results.append(res)
    return results, check_path(path.name, errs, kls, limits)


@dataclass
class _PathPlan:
    """What one path runs: the engine's config and, per group of prompts run together, the driver's arguments."""

    engine_kwargs: Dict[str, Any]
    params: SamplingParams
    groups: List[List[int]]
    prompts: List[List[int]]
    args: List[Dict[str, Any]]  # per group: forced, prefix_lens
    max_prefill_tokens: int


def plan_path(path: ParityPath, device: str, dtype: str, gs: G.GoldenSet) -> _PathPlan:
    longest = max(len(p.prompt_ids) + len(p.tokens) for p in gs.prompts)
    kw = dict(dtype=getattr(torch, dtype), device=device, page_size=path.page_size,
              max_running_req=path.max_running_req, num_page_override=16384 // path.page_size,
              max_seq_len_override=max(512, -(-longest // 256) * 256), attention_backend=path.attention_backend,
              ops_backend=path.ops_backend)
    prompts = [pg.prompt_ids.tolist() for pg in gs.prompts]
    forced = [pg.tokens.tolist() for pg in gs.prompts] if path.forced else None
    groups = [[i] for i in range(len(prompts))] if path.one_at_a_time else [list(range(len(prompts)))]
    args = [dict(forced=None if forced is None else [forced[i] for i in group],
                 prefix_lens=[len(prompts[i]) // 2 for i in group] if path.prefix else None) for group in groups]
    return _PathPlan(kw, SamplingParams(max_tokens=len(gs.prompts[0].tokens), ignore_eos=True), groups, prompts,
                     args, path.max_prefill_tokens)


class _Recorder:
    """Per prompt, the PositionStat of every position the engine produced, and the sampled tokens."""

    def __init__(self, gs: G.GoldenSet) -> None:
        self.gs = gs
        self.stats: Dict[int, Dict[int, PositionStat]] = {uid: {} for uid in range(len(gs.prompts))}
        self.outputs: List[List[int]] = []

    def __call__(self, uid: int, start: int, lp: torch.Tensor) -> None:
        lp = lp.cpu()
        for i in range(lp.shape[0]):
            self.stats[uid][start + i] = compare_row(lp[i], *golden_row(self.gs.prompts[uid], start + i))


def path_engine(plan: _PathPlan, model: str) -> Engine:
    """A new engine configured for the path."""
    return Engine(EngineConfig(model_path=str(zoo.path(model)), tp_info=DistributedInfo(0, 1), **plan.engine_kwargs))


def drive_path(engine: Engine, plan: _PathPlan, gs: G.GoldenSet) -> tuple:
    """The path's prompts through the driver on a built engine: per prompt, the PositionStat of every position,
    and the sampled tokens."""
    rec = _Recorder(gs)
    for group, args in zip(plan.groups, plan.args):
        res = Driver(engine, max_prefill_tokens=plan.max_prefill_tokens).generate(
            [plan.prompts[i] for i in group], plan.params,
            on_logits=lambda uid, pos, lp, base=group[0]: rec(base + uid, pos, lp), **args)
        rec.outputs += [r.output_ids for r in res]
    return rec.stats, rec.outputs


def run_path(path: ParityPath, model: str, device: str, dtype: str, gs: G.GoldenSet) -> tuple:
    """Run the engine along one path: per prompt, the PositionStat of every position, and the sampled tokens."""
    plan = plan_path(path, device, dtype, gs)
    engine = path_engine(plan, model)
    try:
        return drive_path(engine, plan, gs)
    finally:
        engine.shutdown()


def run_paths_tp(paths: List[ParityPath], model: str, device: str, dtype: str, gs: G.GoldenSet,
                 tp: int) -> Dict[str, tuple]:
    """Every path on tp ranks (processes, harness.tp) in one launch, an engine per path and group; rank 0's logits
    are compared. path name -> (stats, outputs) as run_path gives them."""
    from harness.tp import TPRun, tp_generate_many

    runs, owners = [], []
    for path in paths:
        plan = plan_path(path, device, dtype, gs)
        for group, args in zip(plan.groups, plan.args):
            runs.append(TPRun(str(zoo.path(model)), [plan.prompts[i] for i in group], plan.params,
                              engine_kwargs=plan.engine_kwargs, record_logits=True,
                              driver_kwargs={"max_prefill_tokens": plan.max_prefill_tokens}, **args))
            owners.append((path.name, group))
    recorders = {path.name: _Recorder(gs) for path in paths}
    for (name, group), out in zip(owners, tp_generate_many(runs, tp)):
        for uid, logits in out.logits.items():
            recorders[name](group[0] + uid, 0, torch.log_softmax(logits, dim=-1))
        recorders[name].outputs += [r.output_ids for r in out.results]
    return {name: (rec.stats, rec.outputs) for name, rec in recorders.items()}


def obtained_set(gs: G.GoldenSet, stats: Dict[int, Dict[int, PositionStat]], outputs: List[List[int]],
                 path: ParityPath) -> G.GoldenSet:
    """The engine's result in the golden's own format, to diff against it."""
    prompts = []
    for uid, pg in enumerate(gs.prompts):
        n, t = len(pg.prompt_ids), len(pg.tokens)
        rows = [stats[uid].get(pos) for pos in range(n + t - 1)]
        k = pg.prefill_ids.shape[1]
        ids = np.stack([r.top_ids if r else np.full(k, -1) for r in rows]).astype(np.int32)
        lp = np.stack([r.top_lp if r else np.full(k, np.nan) for r in rows]).astype(np.float32)
        tokens = outputs[uid] if not path.forced else [r.argmax if r else -1 for r in rows[n - 1:]]
        prompts.append(G.PromptGolden(pg.name, pg.prompt_ids, np.array(tokens, dtype=np.int32), ids[:n], lp[:n],
                                      ids[n - 1:], lp[n - 1:]))
    return G.GoldenSet(prompts, dict(gs.provenance, obtained_from=f"engine, parity path {path.name}"))


def run_parity(model: str, device: str = "cpu", dtype: str = "float32", paths: List[str] | None = None,
               golden_root: Path = G.GOLDEN_DIR, tp: int = 1) -> ParityResult:
    """Every path against the golden; on the first failing path the engine's result is written beside the golden."""
    gs = G.load_checked(model, device.split(":")[0], dtype, golden_root)
    tol, limits = tolerance(gs, dtype), dist_limits(gs, dtype)
    result = ParityResult(model, device, dtype, tol, gs.provenance["hf_spread_max_abs_logprob"],
                          tie_tolerance(tol, limits), gs.provenance.get("hf_spread"), tp=tp)
    folder = G.golden_dir(model, device.split(":")[0], dtype, golden_root)
    chosen = [p for p in PATHS if (not paths or p.name in paths) and p.applies_to(device)]
    by_tp = run_paths_tp(chosen, model, device, dtype, gs, tp) if tp > 1 else {}
    for path in chosen:
        logger.info("parity %s %s %s: path %s", model, device, dtype, path.name)
        stats, outputs = by_tp[path.name] if tp > 1 else run_path(path, model, device, dtype, gs)
        was_passing = result.passed
        prompts, path_result = evaluate(path, gs, stats, outputs, tol, result.tie_tol, limits)
        result.prompts += prompts
        result.paths.append(path_result)
        if was_passing and not result.passed:
            G.save(obtained_set(gs, stats, outputs, path), folder, stem="golden.obtained")
            result.obtained = str(folder / "golden.obtained.npz")
    return result


def _cmd(args: argparse.Namespace) -> int:
    models = args.model or list(G.GOLDEN_MODELS)
    dtypes = args.dtype or (["bfloat16", "float32"] if args.device.startswith("cuda") else ["float32"])
    failed = False
    for model in models:
        for dtype in dtypes:
            try:
                result = run_parity(model, args.device, dtype, args.path, tp=args.tp)
            except G.GoldenError as e:
                print(f"REFUSED {model} {args.device} {dtype}: {e}", file=sys.stderr)
                failed = True
                continue
            print(write_report(result, write_files=not args.no_report, update=args.update_reports))
            failed |= not result.passed
    if not args.no_sampling and args.device == "cpu":
        from harness import sampling

        failed |= sampling.main_from_parity(update=args.update_reports) != 0
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="compare the engine with the golden files along every engine path")
    p.add_argument("--model", action="append", choices=list(zoo.MODELS), help=f"default: {', '.join(G.GOLDEN_MODELS)}")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", action="append", choices=list(FLOOR),
                   help="default: float32 on cpu; bfloat16 and float32 on cuda")
    p.add_argument("--path", action="append", choices=[p.name for p in PATHS], help="default: every path")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes; gloo on cpu, NCCL on cuda)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--no-report", action="store_true", help="print only; write no report files")
    add_update_flag(where)
    p.add_argument("--no-sampling", action="store_true", help="skip the sampler's distribution tests")
    p.set_defaults(func=_cmd)


__all__ = ["ParityResult", "PathResult", "PromptResult", "run_parity", "tolerance"]
