"""Running parity: each path's engine and driver on the golden prompts, every position compared with the golden."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo, div_even
from engine.models.config import ModelConfig
from engine.utils.hf import cached_load_hf_config
from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, junit, progress, zoo
from harness import golden as G
from harness.compare import ROUTER_TIE, PositionStat, compare_row
from harness.driver import Driver
from harness.parity.gate import (ParityResult, dist_limits, evaluate, golden_row, hf_largest_err, spread_stats,
                                 tie_tolerance, tolerance)
from harness.parity.paths import PATHS, ParityPath
from harness.parity.report import write_report

logger = logging.getLogger(__name__)

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
              ops_backend=path.ops_backend, moe_backend=path.moe_backend, record_router_margins=True)
    prompts = [pg.prompt_ids.tolist() for pg in gs.prompts]
    forced = [pg.tokens.tolist() for pg in gs.prompts] if path.forced else None
    groups = [[i] for i in range(len(prompts))] if path.one_at_a_time else [list(range(len(prompts)))]
    args = [dict(forced=None if forced is None else [forced[i] for i in group],
                 prefix_lens=[len(prompts[i]) // 2 for i in group] if path.prefix else None) for group in groups]
    return _PathPlan(kw, SamplingParams(max_tokens=len(gs.prompts[0].tokens), ignore_eos=True), groups, prompts,
                     args, path.max_prefill_tokens)


class _Recorder:
    """Per prompt, the PositionStat of every position the engine produced, the sampled tokens and (MoE) each
    position's smallest router margin."""

    def __init__(self, gs: G.GoldenSet) -> None:
        self.gs = gs
        self.stats: Dict[int, Dict[int, PositionStat]] = {uid: {} for uid in range(len(gs.prompts))}
        self.margins: Dict[int, Dict[int, float]] = {uid: {} for uid in range(len(gs.prompts))}
        self.outputs: List[List[int]] = []

    def router(self, uid: int, start: int, margins: torch.Tensor) -> None:
        for i, m in enumerate(margins.amin(dim=-1).tolist()):
            self.margins[uid][start + i] = m

    def __call__(self, uid: int, start: int, lp: torch.Tensor) -> None:
        lp = lp.cpu()
        for i in range(lp.shape[0]):
            self.stats[uid][start + i] = compare_row(lp[i], *golden_row(self.gs.prompts[uid], start + i))


def path_engine(plan: _PathPlan, model: str) -> Engine:
    """A new engine configured for the path."""
    return Engine(EngineConfig(model_path=str(zoo.path(model)), tp_info=DistributedInfo(0, 1), **plan.engine_kwargs))


def drive_path(engine: Engine, plan: _PathPlan, gs: G.GoldenSet) -> tuple:
    """The path's prompts through the driver on a built engine: per prompt, the PositionStat of every position, the
    sampled tokens and the router margins."""
    rec = _Recorder(gs)
    for group, args in zip(plan.groups, plan.args):
        res = Driver(engine, max_prefill_tokens=plan.max_prefill_tokens).generate(
            [plan.prompts[i] for i in group], plan.params,
            on_logits=lambda uid, pos, lp, base=group[0]: rec(base + uid, pos, lp),
            on_router=lambda uid, pos, m, base=group[0]: rec.router(base + uid, pos, m), **args)
        rec.outputs += [r.output_ids for r in res]
    return rec.stats, rec.outputs, rec.margins


def run_path(path: ParityPath, model: str, device: str, dtype: str, gs: G.GoldenSet) -> tuple:
    """Run the engine along one path: per prompt, the PositionStat of every position, the sampled tokens and the
    router margins."""
    plan = plan_path(path, device, dtype, gs)
    engine = path_engine(plan, model)
    try:
        return drive_path(engine, plan, gs)
    finally:
        engine.shutdown()


def run_paths_tp(paths: List[ParityPath], model: str, device: str, dtype: str, gs: G.GoldenSet,
                 tp: int) -> Dict[str, tuple]:
    """Every path on tp ranks (processes, harness.tp) in one launch, an engine per path and group; rank 0's logits
    are compared. path name -> (stats, outputs, margins) as run_path gives them."""
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
        for uid, margins in (out.router_margins or {}).items():
            recorders[name].router(group[0] + uid, 0, margins)
        recorders[name].outputs += [r.output_ids for r in out.results]
    return {name: (rec.stats, rec.outputs, rec.margins) for name, rec in recorders.items()}


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


def model_is_moe(model: str) -> bool:
    return ModelConfig.from_hf(cached_load_hf_config(str(zoo.path(model)))).is_moe


def run_parity(model: str, device: str = "cpu", dtype: str = "float32", paths: List[str] | None = None,
               golden_root: Path = G.GOLDEN_DIR, tp: int = 1) -> ParityResult:
    """Every path against the golden; on the first failing path the engine's result is written beside the golden."""
    gs = G.load_checked(model, device.split(":")[0], dtype, golden_root)
    is_moe = model_is_moe(model)
    tol, limits = tolerance(gs, dtype, is_moe), dist_limits(gs, dtype, is_moe)
    result = ParityResult(model, device, dtype, tol, hf_largest_err(gs, dtype, is_moe), tie_tolerance(tol, limits),
                          spread_stats(gs, dtype, is_moe), tp=tp, router_tie=ROUTER_TIE[dtype] if is_moe else None)
    folder = G.golden_dir(model, device.split(":")[0], dtype, golden_root)
    chosen = [p for p in PATHS if (not paths or p.name in paths) and p.applies_to(device, is_moe)]
    clock = progress.Stopwatch()
    by_tp = run_paths_tp(chosen, model, device, dtype, gs, tp) if tp > 1 else {}  # the first path's line times all
    for path in chosen:
        logger.info("parity %s %s %s: path %s", model, device, dtype, path.name)
        stats, outputs, margins = by_tp[path.name] if tp > 1 else run_path(path, model, device, dtype, gs)
        was_passing = result.passed
        prompts, path_result = evaluate(path, gs, stats, outputs, tol, result.tie_tol, limits,
                                        margins if is_moe else None, result.router_tie or 0.0)
        path_result.seconds = clock.lap()
        passed = path_result.passed and all(p.passed for p in prompts)
        progress.line("parity", f"{model} {device} {dtype} {path.name}", "PASS" if passed else "FAIL",
                      path_result.seconds)
        result.prompts += prompts
        result.paths.append(path_result)
        if was_passing and not result.passed:
            G.save(obtained_set(gs, stats, outputs, path), folder, stem="golden.obtained")
            result.obtained = str(folder / "golden.obtained.npz")
    return result


def _check(args: argparse.Namespace, models: List[str], dtypes: List[str]) -> None:
    """What the user asked for, before any engine runs: the device, the ranks, the paths, a golden for every model and
    dtype, where the JUnit file goes."""
    cuda = args.device.startswith("cuda")
    check_device(args.device, flashinfer=cuda)
    if args.tp < 1:
        raise UserError(f"--tp {args.tp}: a run has at least one rank; give --tp 1 or more")
    if cuda and args.tp > torch.cuda.device_count():
        raise UserError(f"--tp {args.tp}: each rank needs a GPU and this machine has {torch.cuda.device_count()}; "
                        f"give --tp {torch.cuda.device_count()} or fewer")
    gpu_only = [p.name for p in PATHS if p.name in (args.path or []) and not p.applies_to(args.device, is_moe=True)]
    if gpu_only:
        raise UserError(f"--path {', '.join(gpu_only)}: runs only on a GPU; use --device cuda, or leave it out")
    junit.check_path(args.junit)
    for model in models:
        if args.tp > 1:
            _check_tp(model, args.tp)
        for dtype in dtypes:
            G.load_checked(model, args.device.split(":")[0], dtype)


def _check_tp(model: str, tp: int) -> None:
    """The engine's rule (engine.engine): TP splits the attention heads evenly; fewer KV heads are replicated."""
    mc = ModelConfig.from_hf(cached_load_hf_config(str(zoo.path(model))))
    try:
        div_even(mc.num_qo_heads, tp)
        div_even(mc.num_kv_heads, tp, allow_replicate=True)
    except ValueError as e:
        raise UserError(f"--tp {tp} does not fit {model} ({mc.num_qo_heads} attention heads, {mc.num_kv_heads} KV "
                        f"heads: {e}); give a --tp that divides its attention heads") from None


def command(args: argparse.Namespace) -> int:
    models = args.model or list(G.GOLDEN_MODELS)
    dtypes = args.dtype or (["bfloat16", "float32"] if args.device.startswith("cuda") else ["float32"])
    _check(args, models, dtypes)
    failed, suites = False, []
    for model in models:
        for dtype in dtypes:
            result = run_parity(model, args.device, dtype, args.path, tp=args.tp)
            print(write_report(result, write_files=not args.no_report, update=args.update_reports))
            failed |= not result.passed
            suites.append(junit.parity_suite(result))
    if not args.no_sampling and args.device == "cpu":
        from harness.sampling.run import main_from_parity

        grid = main_from_parity(update=args.update_reports)
        failed |= not grid.passed
        suites.append(junit.sampling_suite(grid, "cpu"))
    if args.junit:
        print(f"junit: {junit.write(args.junit, suites)}")
    return EXIT_FINDING if failed else EXIT_PASS
