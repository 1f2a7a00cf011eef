"""`python -m harness fuzz`: search for the budget, or replay one case; a summary under build/reports/fuzz/."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harness import EXIT_FINDING, EXIT_PASS, junit
from harness.fuzz.case import Case
from harness.fuzz.faults import FAULTS, planted

if TYPE_CHECKING:  # hypothesis, which the search needs, is imported only when the verb runs
    from harness.fuzz.invariants import Evaluator
    from harness.models import ModelRef

DEFAULT_BUDGET = {"cpu": 60.0, "cuda": 120.0}
DEFAULT_MODEL = "tiny-qwen3"


def replay(path: Path, plant: str | None = None, evaluator: "Evaluator | None" = None,
           model: "ModelRef | None" = None) -> tuple:
    """Run the case in path again on a fresh engine, after the history it records, every invariant (with the planted
    fault named, if any): (case, failure or None). model: the case's (default: the zoo's model of its name)."""
    from harness.fuzz.invariants import Evaluator

    case = Case.read(path)
    own = evaluator is None
    evaluator = evaluator or Evaluator(model or case.model, case.device)
    try:
        with planted(plant):
            evaluator.fresh()
            for past in case.history:  # the state they leave on the engine is what the case needs
                evaluator.evaluate(case.config, past.workload, only=past.only)
            return case, evaluator.evaluate(case.config, case.workload)
    finally:
        if own:
            evaluator.close()


def _replay(args: argparse.Namespace, model: "ModelRef") -> int:
    from harness.fuzz.report import failure_text

    case = Case.read(args.replay)
    if case.planted and case.planted != args.plant:
        print(f"note: this case was found with the planted fault {case.planted}; --plant {case.planted} plants it")
    _, failure = replay(args.replay, args.plant, model=model)
    print(f"recorded: {case.failure.invariant} in the {case.failure.stage} run" if case.failure else "recorded: pass")
    if case.history:
        print(f"ran first on the fresh engine: {len(case.history)} case(s) of its history (the failure was reproduced "
              f"{case.reproduced})")
    text = None if failure is None else failure_text(Case(case.model, case.device, case.config, case.workload,
                                                           failure, args.plant, case.seed,
                                                           model_args=case.model_args), None)
    if args.junit:
        name = f"fuzz.{case.model}.{case.device.split(':')[0]}"
        junit.write(args.junit, [junit.Suite(name, [junit.TestCase(name, f"replay {args.replay}", failure=text)])])
    if text is None:
        print(f"replay of {args.replay}: every invariant holds")
        return EXIT_PASS
    print(f"replay of {args.replay}: FAIL\n{text}")
    return EXIT_FINDING


def _cmd(args: argparse.Namespace) -> int:
    from harness import progress
    from harness.fuzz import report
    from harness.fuzz.search import FuzzOptions, PhaseStats, fuzz
    from harness.report import written_to

    model = _check(args)
    if args.replay:
        return _replay(args, model)
    budget = args.budget if args.budget is not None else DEFAULT_BUDGET[args.device.split(":")[0]]
    opts = FuzzOptions(model=model, device=args.device, dtype=args.dtype, seed=args.seed, budget=budget,
                       planted=args.plant, batch_invariant=True if args.batch_invariant or (
                           args.plant and FAULTS[args.plant].batch_invariant) else None,
                       long=args.long or bool(args.plant and FAULTS[args.plant].long))
    start, clock = time.monotonic(), progress.Stopwatch()
    with progress.bar(total=round(budget), desc="fuzz", unit="s", bar_format="{desc} {n:.0f}/{total} s, {postfix}"
                      ) as bar:
        def tick(status: str) -> None:
            bar.n = round(time.monotonic() - start)
            bar.set_postfix_str(status)

        def phase_done(number: int, stats: PhaseStats) -> None:
            progress.line("fuzz", f"{model.name} {args.device} configuration {number} ({stats.config.dtype}, "
                          f"{stats.cases} cases)", "FAIL" if stats.failure else "PASS", clock.lap())

        with planted(args.plant):
            result = fuzz(opts, tick=tick, on_phase=phase_done)
    print(report.table(result))
    print(report.summary(result))
    print(written_to(report.write(result, args.update_reports), args.update_reports))
    if args.junit:
        print(f"junit: {junit.write(args.junit, [junit.fuzz_suite(result)])}")
    if result.case is not None:
        print("\nthe minimal failing case:\n" + report.failure_text(result.case, result.case_path, result.first))
        return EXIT_FINDING
    return EXIT_PASS


def _check(args: argparse.Namespace) -> "ModelRef":
    """What this machine cannot run is refused before any engine starts; the model to run."""
    from harness import UserError, check_device
    from harness import golden as G
    from harness.fuzz.strategies import dtypes
    from harness.models import resolve_model

    if args.replay:  # the case's model, unless the command names one (a folder's model: the case's replay line does)
        case = Case.read(args.replay)
        device, wanted = case.device, [case.config.dtype]
        model = resolve_model(args, case.model, verb="fuzz")
    else:
        device, wanted = args.device, dtypes(args.device, args.dtype)
        model = resolve_model(args, DEFAULT_MODEL, verb="fuzz")
    kind = device.split(":")[0]
    check_device(device, flashinfer=kind == "cuda")  # the CUDA run's engines are FlashInfer's
    if args.plant and FAULTS[args.plant].device not in ("any", kind):
        raise UserError(f"--plant {args.plant} lives where {device} has no code ({FAULTS[args.plant].description}); "
                        f"use --device {FAULTS[args.plant].device}")
    junit.check_path(args.junit)
    if args.batch_invariant and kind == "cuda":
        raise UserError("--batch-invariant: the engine's batch-invariant mode runs on the CPU only; use --device cpu")
    if args.budget is not None and args.budget <= 0:
        raise UserError(f"--budget {args.budget}: give a positive number of seconds")
    for dtype in wanted:
        G.load_checked(model, kind, dtype)  # its tolerance is parity's: a missing golden is refused here
    return model


def add_arguments(p: argparse.ArgumentParser) -> None:
    from harness.models import add_model_arguments
    from harness.report import add_update_flag

    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    add_model_arguments(p, DEFAULT_MODEL, many=False, golden=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on cpu; bfloat16 and float32 drawn on cuda")
    p.add_argument("--seed", type=int, default=0, help="hypothesis's seed (the same seed draws the same cases)")
    p.add_argument("--budget", type=float, help="seconds of search (default: 60 on cpu, 120 on cuda); shrinking a "
                   "failure takes up to half as much again")
    p.add_argument("--replay", type=Path, metavar="FILE", help="run the case a failing search wrote, and exit")
    p.add_argument("--plant", choices=list(FAULTS), help="plant a known fault in this process's engine and driver")
    p.add_argument("--batch-invariant", action="store_true", help="every configuration in batch-invariant mode "
                   "(EngineConfig.batch_invariant; default: drawn on cpu, off on cuda; on with the mode's --plant faults)")
    p.add_argument("--long", action="store_true", help="the long tier: a prompt of 1025-1400 tokens in every case "
                   "(past a block of 1024 pages at page_size 1), short requests decoding beside its chunks, deep "
                   "shared prefixes (on with the long faults' --plant)")
    junit.add_flag(p)
    add_update_flag(p)
    p.set_defaults(func=_cmd)
