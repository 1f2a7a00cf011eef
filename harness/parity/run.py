"""Running parity: each path's engine and driver on the golden prompts, every position compared with the golden."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from engine import Engine, EngineConfig
from engine.distributed import DistributedInfo, div_even
from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, junit, progress, subjects
from harness import golden as G
from harness import hf_referee
from harness import prompts as P
from harness.compare import ROUTER_TIE, PositionStat, compare_row
from harness.driver import Driver
from harness.models import ModelRef, as_model, resolve_models
from harness.parity.gate import (ParityResult, dist_limits, evaluate, golden_row, hf_largest_err, own_spread,
                                 tie_tolerance, tolerance)
from harness.parity.failure import failure_block, first_failure
from harness.parity.paths import PATHS, ParityPath
from harness.parity.plan import PathPlan as _PathPlan, plan_path
from harness.parity.remote import REMOTE, REMOTE_PATHS, run_remote_path
from harness.parity.rerun import compare, run_again
from harness.parity.report import write_report
from harness.report import REPO_ROOT
from harness.subjects.base import Subject, check_top_k

logger = logging.getLogger(__name__)


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


def path_engine(plan: _PathPlan, model: ModelRef | str, engine: str = subjects.OWN) -> Engine:
    """A new engine configured for the path: this project's, or the class --engine names (harness.subjects)."""
    config = EngineConfig(model_path=str(as_model(model).folder), tp_info=DistributedInfo(0, 1), **plan.engine_kwargs)
    return subjects.engine_class(engine)(config)


def drive_path(engine: Engine, plan: _PathPlan, gs: G.GoldenSet) -> tuple:
    """The path's prompts through the driver on a built engine: per prompt, the PositionStat of every position, the
    sampled tokens and the router margins."""
    rec = _Recorder(gs)
    for group, args in zip(plan.groups, plan.args):
        res = Driver(engine, max_prefill_tokens=plan.max_prefill_tokens).generate(
            [plan.prompts[i] for i in group], [plan.params[i] for i in group],
            on_logits=lambda uid, pos, lp, base=group[0]: rec(base + uid, pos, lp),
            on_router=lambda uid, pos, m, base=group[0]: rec.router(base + uid, pos, m), **args)
        rec.outputs += [r.output_ids for r in res]
    return rec.stats, rec.outputs, rec.margins


def run_path(path: ParityPath, model: ModelRef | str, device: str, dtype: str, gs: G.GoldenSet,
             batch_invariant: bool = False, engine_spec: str = subjects.OWN) -> tuple:
    """Run the engine along one path: per prompt, the PositionStat of every position, the sampled tokens and the
    router margins."""
    plan = plan_path(path, device, dtype, gs, batch_invariant)
    engine = path_engine(plan, model, engine_spec)
    try:
        return drive_path(engine, plan, gs)
    finally:
        engine.shutdown()


def run_paths_tp(paths: List[ParityPath], model: ModelRef | str, device: str, dtype: str, gs: G.GoldenSet,
                 tp: int, batch_invariant: bool = False) -> Dict[str, tuple]:
    """Every path on tp ranks (processes, harness.tp) in one launch, an engine per path and group; rank 0's logits
    are compared. path name -> (stats, outputs, margins) as run_path gives them."""
    from harness.tp import TPRun, tp_generate_many

    runs, owners = [], []
    for path in paths:
        plan = plan_path(path, device, dtype, gs, batch_invariant)
        for group, args in zip(plan.groups, plan.args):
            runs.append(TPRun(str(as_model(model).folder), [plan.prompts[i] for i in group],
                              [plan.params[i] for i in group],
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


def model_is_moe(model: ModelRef | str) -> bool:
    return as_model(model).is_moe


OBTAINED_DIR = REPO_ROOT / "build" / "parity"  # git-ignored: the engine's result of a failing run


def select_prompts(gs: G.GoldenSet, prompt: str | None) -> List[int]:
    """The golden prompts to run: every one, or the one --prompt names (its index in the golden, or its name)."""
    if prompt is None:
        return list(range(len(gs.prompts)))
    names = [p.name for p in gs.prompts]
    if prompt.isdigit() and int(prompt) < len(names):
        return [int(prompt)]
    if prompt in names:
        return [names.index(prompt)]
    raise UserError(f"--prompt {prompt}: the golden of {gs.provenance['model']} has no such prompt; give an index "
                    f"from 0 to {len(names) - 1} or one of its names: {', '.join(names)}")


def _judged(run: tuple, indices: List[int]) -> tuple:
    """A run of the whole golden set cut to the prompts judged (indices), renumbered as gs's subset is."""
    stats, outputs, margins = run
    return ({u: stats[i] for u, i in enumerate(indices)}, [outputs[i] for i in indices],
            {u: margins[i] for u, i in enumerate(indices)})


def run_parity(model: ModelRef | str, device: str = "cpu", dtype: str = "float32", paths: List[str] | None = None,
               golden_root: Path | None = None, tp: int = 1, prompts: P.PromptSet | None = None,
               prompt: str | None = None, obtained_root: Path = OBTAINED_DIR,
               batch_invariant: bool = False, engine: str = subjects.OWN, rerun_failure: bool = False) -> ParityResult:
    """Every path against the golden (under golden_root, default: the model's), or only its prompt `prompt`; on the
    first failing path the engine's result is written under obtained_root (build/parity/), and the first failure is
    shown (harness.parity.failure). batch_invariant: the engines in that mode (EngineConfig.batch_invariant); engine:
    the engine under test (--engine, harness.subjects); rerun_failure: the failing path of a driven engine is run
    again in a fresh process (harness.parity.rerun), and the result says whether its bits were the same."""
    full = G.load_checked(model, device.split(":")[0], dtype, golden_root, prompts)
    model = as_model(model, golden_root)
    indices = select_prompts(full, prompt)
    gs = G.GoldenSet([full.prompts[i] for i in indices], full.provenance, full.reference_command)
    is_moe = model_is_moe(model)
    tol, limits = tolerance(gs, dtype, is_moe), dist_limits(gs, dtype, is_moe)
    result = ParityResult(model.name, device, dtype, tol, hf_largest_err(gs, dtype, is_moe), tie_tolerance(tol, limits),
                          own_spread(gs, dtype, is_moe), tp=tp, router_tie=ROUTER_TIE[dtype] if is_moe else None,
                          batch_invariant=batch_invariant, engine=engine)
    result.model_args = model.args + model.golden_args
    result.hf_findings = hf_referee.findings(gs.provenance)
    folder = obtained_root / model.name / (f"{device.split(':')[0]}-{dtype}" + result.mode_suffix)
    black_box = not subjects.driven(engine)
    chosen = [p for p in (REMOTE_PATHS if black_box else PATHS)
              if (not paths or p.name in paths) and p.applies_to(device, is_moe)]
    clock = progress.Stopwatch()
    peer = subjects.open_subject(engine, model) if black_box else None
    if peer is not None:
        check_top_k(peer, engine)
        result.engine_info, result.top_k = peer.provenance(), peer.top_k
    # the first path's line times all ranks' runs
    # every path runs the whole set, even for one prompt: alone, a prompt has other shapes than in the batch it
    # failed in (other GEMM row counts, other rounding), so a re-run of it alone could pass where the gate failed
    by_tp = run_paths_tp(chosen, model, device, dtype, full, tp, batch_invariant) if tp > 1 else {}
    try:
        for path in chosen:
            _judge_path(result, path, model, device, dtype, full, gs, indices, tol, limits, by_tp, peer, folder, clock,
                        rerun_failure)
    finally:
        if peer is not None:
            peer.close()
    if not result.passed:
        from transformers import AutoTokenizer

        result.failure = failure_block(result, full, AutoTokenizer.from_pretrained(model.folder)) or ""
    return result


def _judge_path(result: ParityResult, path: ParityPath, model: ModelRef, device: str, dtype: str, full: G.GoldenSet,
                gs: G.GoldenSet, indices: List[int], tol: float, limits: Dict[str, float] | None,
                by_tp: Dict[str, tuple], peer: Subject | None, folder: Path, clock: progress.Stopwatch,
                rerun_failure: bool) -> None:
    """One path run and judged into result; the first failing path's result is kept in the golden's format."""
    is_moe = result.router_tie is not None
    logger.info("parity %s %s %s: path %s", model.name, device, dtype, path.name)
    if peer is not None:
        run = run_remote_path(path, peer, full)
    else:
        run = by_tp[path.name] if result.tp > 1 else run_path(path, model, device, dtype, full,
                                                                result.batch_invariant, result.engine)
    stats, outputs, margins = _judged(run, indices)
    was_passing = result.passed
    prompts, path_result = evaluate(path, gs, stats, outputs, tol, result.tie_tol, limits,
                                    margins if is_moe else None, result.router_tie or 0.0, indices)
    path_result.seconds = clock.lap()
    passed = path_result.passed and all(p.passed for p in prompts)
    progress.line("parity", f"{model.name} {device} {dtype}{result.mode_suffix} {path.name}",
                  "PASS" if passed else "FAIL",
                  path_result.seconds)
    result.prompts += prompts
    result.paths.append(path_result)
    if was_passing and not result.passed:
        G.save(obtained_set(gs, stats, outputs, path), folder, stem="golden.obtained")
        result.obtained = str(folder / "golden.obtained.npz")
        if rerun_failure and peer is None and result.tp == 1:  # a driven engine: the failure's every time?
            _check_deterministic(result, path, model, device, dtype, full, run[0])


def _check_deterministic(result: ParityResult, path: ParityPath, model: ModelRef, device: str, dtype: str,
                         full: G.GoldenSet, stats: Dict[int, Dict[int, PositionStat]]) -> None:
    """The failing path again in a fresh process: where the failing prompt's bits differ, the result says so."""
    uid = first_failure(result, path.name).prompt
    logger.info("parity %s: path %s failed; running it again in a fresh process", model.name, path.name)
    again = run_again(run_path, path, model, device, dtype, full, result.batch_invariant, result.engine, uid)
    found = compare(stats[uid], again)
    if found is not None:
        result.nondeterministic = found.text()


def _check(args: argparse.Namespace, models: List[ModelRef], dtypes: List[str],
           prompts: P.PromptSet | None = None) -> None:
    """What the user asked for, before any engine runs: the device, the ranks, the paths, a golden for every model and
    dtype, where the JUnit file goes."""
    cuda = args.device.startswith("cuda")
    check_device(args.device, flashinfer=cuda)
    if args.tp < 1:
        raise UserError(f"--tp {args.tp}: a run has at least one rank; give --tp 1 or more")
    if cuda and args.tp > torch.cuda.device_count():
        raise UserError(f"--tp {args.tp}: each rank needs a GPU and this machine has {torch.cuda.device_count()}; "
                        f"give --tp {torch.cuda.device_count()} or fewer")
    if cuda and args.batch_invariant:
        raise UserError("--batch-invariant: the engine's batch-invariant mode runs on the CPU only; use --device cpu")
    gpu_only = [p.name for p in PATHS if p.name in (args.path or []) and not p.applies_to(args.device, is_moe=True)]
    if gpu_only:
        raise UserError(f"--path {', '.join(gpu_only)}: runs only on a GPU; use --device cuda, or leave it out")
    junit.check_path(args.junit)
    subjects.check(args.engine)
    if args.engine != subjects.OWN and (args.tp > 1 or args.explain):
        raise UserError(f"--engine {args.engine}: --tp and --explain run this project's engine only; leave them out")
    if not subjects.driven(args.engine):
        driven_only = [p for p in args.path or [] if p not in REMOTE]
        if driven_only or args.batch_invariant:
            what = f"--path {', '.join(driven_only)}" if driven_only else "--batch-invariant"
            raise UserError(f"{what}: needs an engine whose batches the harness builds; --engine {args.engine} "
                            f"runs the paths {', '.join(REMOTE)}")
    for model in models:
        if args.tp > 1:
            _check_tp(model, args.tp)
        for dtype in dtypes:
            gs = G.load_checked(model, args.device.split(":")[0], dtype, prompts=prompts)
            select_prompts(gs, args.prompt)
            own_spread(gs, dtype, model.is_moe)  # a golden without its float64 reference is refused here


def _check_tp(model: ModelRef, tp: int) -> None:
    """The engine's rule (engine.engine): TP splits the attention heads evenly; fewer KV heads are replicated."""
    mc = model.config
    try:
        div_even(mc.num_qo_heads, tp)
        div_even(mc.num_kv_heads, tp, allow_replicate=True)
    except ValueError as e:
        raise UserError(f"--tp {tp} does not fit {model.name} ({mc.num_qo_heads} attention heads, {mc.num_kv_heads} KV "
                        f"heads: {e}); give a --tp that divides its attention heads") from None


def command(args: argparse.Namespace) -> int:
    models = resolve_models(args, G.GOLDEN_MODELS, verb="parity")
    prompts = P.read_file(args.prompts) if args.prompts else None
    dtypes = args.dtype or (["bfloat16", "float32"] if args.device.startswith("cuda") else ["float32"])
    _check(args, models, dtypes, prompts)
    failed, suites = False, []
    for model in models:
        for dtype in dtypes:
            result = run_parity(model, args.device, dtype, args.path, tp=args.tp, prompts=prompts, prompt=args.prompt,
                                batch_invariant=args.batch_invariant, engine=args.engine, rerun_failure=True)
            print(write_report(result, write_files=not args.no_report, update=args.update_reports))
            failed |= not result.passed
            suites.append(junit.parity_suite(result))
            if args.explain and not result.passed:
                from harness.parity.explain import explain_failure

                golden = G.load_checked(model, args.device.split(":")[0], dtype, prompts=prompts)
                print(explain_failure(result, golden, model))
    if not args.no_sampling and args.device == "cpu" and args.prompt is None and args.engine == subjects.OWN:
        from harness.sampling.run import main_from_parity

        own = [m for m in models if not m.zoo]  # a user's own folders give the real-logit cases, not the zoo's
        grid = main_from_parity(update=args.update_reports, **({"real_models": own} if own else {}))
        failed |= not grid.passed
        suites.append(junit.sampling_suite(grid, "cpu"))
    elif not args.no_sampling and args.engine != subjects.OWN:
        print(f"sampling: not run here; its sampler's tests: python -m harness sampling --engine {args.engine}")
    if args.junit:
        print(f"junit: {junit.write(args.junit, suites)}")
    return EXIT_FINDING if failed else EXIT_PASS
