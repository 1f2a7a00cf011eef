"""python -m harness resolution: every chosen check against every fault family that applies to it."""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List, Sequence

import torch

from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, progress
from harness.models import ModelRef, resolve_models
from harness.resolution.adapters import ComponentCheck, FuzzCheck
from harness.resolution.checks import Check, ParityCheck, SamplingCheck
from harness.resolution.faults import FAMILIES, Family
from harness.resolution.report import CheckResult, Row, write_report
from harness.resolution.search import find_threshold

DEFAULT_RATIO = 1.25  # the bracket each search ends with: largest missed / smallest detected
DEFAULT_CHECKS = {"cpu": ("parity-fp32", "components", "fuzz", "sampling"),
                  "cuda": ("parity-bf16", "parity-fp32", "components", "fuzz", "sampling")}
DEFAULT_MODELS = {"cpu": ("tiny-qwen3", "smollm2-135m", "tiny-gemma3"), "cuda": ("smollm2-135m", "tiny-qwen3")}
PER_MODEL = ("parity-fp32", "parity-bf16")


def _parity(dtype: str) -> Callable[[argparse.Namespace, ModelRef | None], ParityCheck]:
    def make(args: argparse.Namespace, model: ModelRef | None) -> ParityCheck:
        return ParityCheck(model, args.device, dtype, args.path, args.threads)
    return make


# check kind -> (the command's arguments, the model or None) -> Check; a new kind of check registers here
CHECKS: Dict[str, Callable[[argparse.Namespace, ModelRef | None], Check]] = {
    "parity-fp32": _parity("float32"),
    "parity-bf16": _parity("bfloat16"),
    "sampling": lambda args, model: SamplingCheck(args.device),
    "components": lambda args, model: ComponentCheck(args.device),
    "fuzz": lambda args, model: FuzzCheck(args.device, budget=args.fuzz_budget),
}


def measure(kind: str, check: Check, families: Sequence[Family], ratio: float = DEFAULT_RATIO,
            on_row: Callable[[CheckResult, Row], None] | None = None) -> CheckResult:
    """The baseline, then one search per family; faults that graphs bake come last (each of their probes builds
    an engine, so the clean engine is built once for the others)."""
    try:
        start = time.perf_counter()
        base = check.baseline()
        result = CheckResult(kind, check.name, "", base, time.perf_counter() - start)
        baked = getattr(check, "baked", lambda f: False)
        for fam in sorted(families, key=baked):
            search = None
            if not base.detected:
                e_min, e_max = check.search_range(fam)
                search = find_threshold(lambda e, f=fam: check.probe(f, e), e_min, e_max, ratio)
            result.rows.append(Row(fam.name, search))
            if on_row is not None:
                on_row(result, result.rows[-1])
        result.description = check.describe()
        result.builds = getattr(check, "builds", None)
        return result
    finally:
        check.close()


def _print_row(result: CheckResult, row: Row) -> None:
    s = row.search
    if s is None:
        progress.line("resolution", f"{result.name} {row.family}",
                      f"not searched: fails with no fault ({result.baseline.detail})", result.baseline_seconds)
        return
    progress.line("resolution", f"{result.name} {row.family}",
                  f"smallest detected {_e(s.smallest_detected)}, largest missed {_e(s.largest_missed)} ({s.status}; "
                  f"{len(s.probes)} probes)", s.seconds)


def _e(e: float | None) -> str:
    return "-" if e is None else f"{e:.3g}"


def _families(check: Check, chosen: Sequence[Family]) -> List[Family]:
    """The chosen families the check can be probed with."""
    names = getattr(check, "families", None)
    return [f for f in chosen if f.target == check.target and (names is None or f.name in names)]


def cells_cmd(args: argparse.Namespace) -> int:
    """--cells: every committed golden cell of this device (or of the --model names), its parity gate against the
    engine families, into the cells table (harness.resolution.cells)."""
    from harness.models import as_model
    from harness.resolution import cells as C

    device_type = args.device.split(":")[0]
    names = set(args.model or [])
    chosen = [c for c in C.committed(device_type) if not names or c.model in names]
    if not chosen:
        raise UserError(f"--cells: no committed golden of {device_type}" + (f" for {', '.join(sorted(names))}"
                                                                              if names else "") + " under golden/")
    families = [FAMILIES[f] for f in (args.family or C.FAMILY_ORDER)]
    checks = [(cell, ParityCheck(as_model(cell.model, cell.golden_root), args.device, cell.dtype, args.path,
                                 args.threads)) for cell in chosen]  # every golden read before the first probe
    rows, where = [], ""
    for cell, check in checks:
        progress.line("resolution", f"cell {cell.key}", "start", 0.0)
        result = measure(f"parity-{'fp32' if cell.dtype == 'float32' else 'bf16'}", check,
                         _families(check, families), args.ratio, _print_row)
        rows.append(C.row(cell, result, check.tol))
        where = C.write(rows, args.update_reports)  # after every cell: a run cut short keeps what it measured
    print(where)
    return EXIT_FINDING if any(r["families"] and all(v["status"].startswith("not searched")
                                                     for v in r["families"].values()) for r in rows) else EXIT_PASS


def cmd(args: argparse.Namespace) -> int:
    check_device(args.device, flashinfer=args.device.startswith("cuda"))
    if args.cells:
        torch.set_num_threads(args.threads)
        return cells_cmd(args)
    if args.ratio <= 1.0:
        raise UserError(f"--ratio {args.ratio}: the search's final bracket must be wider than 1; give e.g. 1.25")
    if args.fuzz_budget <= 0:
        raise UserError(f"--fuzz-budget {args.fuzz_budget}: give a positive number of seconds")
    device = args.device
    kinds = args.check or list(DEFAULT_CHECKS[device.split(":")[0]])
    models = resolve_models(args, DEFAULT_MODELS[device.split(":")[0]], verb="resolution")
    chosen = [FAMILIES[f] for f in args.family] if args.family else list(FAMILIES.values())
    if args.threads < 1:
        raise UserError(f"--threads {args.threads}: give 1 or more")
    torch.set_num_threads(args.threads)
    # every check is made (its golden read, its cases listed) before the first one runs: a refusal comes first
    checks = [(kind, CHECKS[kind](args, model))
              for kind in kinds for model in (models if kind in PER_MODEL else [None])]
    settings = {"ratio": args.ratio, "path": args.path, "checks": kinds, "models": [m.name for m in models],
                "families": [f.name for f in chosen], "threads": args.threads, "fuzz_budget_s": args.fuzz_budget}
    runnable = []
    for kind, check in checks:
        families = _families(check, chosen)
        if families:
            runnable.append((kind, check, families))
        else:
            check.close()
    if not runnable:
        raise UserError("no chosen family applies to the chosen checks; parity and the component checks take "
                        "softmax-decode, softmax-prefill, rope-base and kv-wrong-slot, the fuzzer softmax-decode and "
                        "kv-wrong-slot, sampling sampler-softmax, temperature and top-p")
    start = time.perf_counter()
    results: List[CheckResult] = []
    for i, (kind, check, families) in enumerate(runnable):
        results.append(measure(kind, check, families, args.ratio, _print_row))
        # rewritten after every check: a run cut short leaves the checks it finished
        where = write_report(results, device, dict(settings, checks_left=len(runnable) - i - 1),
                             time.perf_counter() - start, args.update_reports)
    print(where)
    return EXIT_FINDING if any(r.baseline.detected for r in results) else EXIT_PASS
