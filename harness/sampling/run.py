"""python -m harness sampling: the sampler's draws against the float64 oracle, with stated power.

Each case is one batch of rows with their own parameters; the batch is repeated many times in one `sample` call
and drawn N times per row. Every row gets exact checks (greedy rows are the argmax, invalid rows -1, no draw
outside the oracle's support) and, when its support has two or more tokens, a chi-square goodness of fit at the
Bonferroni-corrected level. N comes from a power analysis (harness.sampling.stats), capped for costly cases.
"""

from __future__ import annotations

import argparse
import time
import zlib
from dataclasses import fields
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import numpy as np
import torch

from engine.core import Batch, Req, SamplingParams
from engine.sample import BatchSamplingArgs, Sampler
from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, junit, progress, report
from harness.models import ModelRef, resolve_models
from harness.sampling import oracle
from harness.sampling.cases import REAL_MODELS, Case, all_cases, describe
from harness.sampling.report import GridResult, RowResult, table_rows, write_report
from harness.sampling.stats import chi_square, detectable_tv, power_at, required_draws

# (logits [rows, vocab] on the device, args with one uniform per row) -> tokens [rows]
SampleFn = Callable[[torch.Tensor, BatchSamplingArgs], torch.Tensor]

MIN_MARGIN = 1e-5  # a float32 sampler may decide a threshold comparison closer than ~1e-6 differently
CHUNK_ELEMENTS = 1 << 24  # logits elements per sample call: 64 MiB of float32 (the sort holds a few copies)
# draws x vocab per case: on 2 CPU cores ~5000 draws per row at 49152 tokens, ~950 at 262144; a GPU affords full power
DEFAULT_MAX_COST = {"cpu": 2.5e8, "cuda": 1e11}
GREEDY_ONLY_DRAWS = 2000  # cases without a random row only need enough draws to show they never stray


def make_batch(params: Sequence[SamplingParams]) -> Batch:
    """A decode batch of one-token requests: all Sampler.prepare reads is their sampling parameters."""
    reqs = [Req(input_ids=torch.zeros(1, dtype=torch.int32), table_idx=i, cached_len=0, output_len=1, uid=i,
                sampling_params=p, cache_handle=None) for i, p in enumerate(params)]
    return Batch(reqs, "decode")


def _tile(args: BatchSamplingArgs, reps: int) -> BatchSamplingArgs:
    """The args of the batch repeated reps times (row order: the whole batch, then the whole batch again...),
    without the rows' keys: the grid hands every draw its own uniforms."""
    return BatchSamplingArgs(**{f.name: None if (v := getattr(args, f.name)) is None else v.repeat(reps)
                                for f in fields(args) if f.name not in ("keys", "draws")})


def draw(case: Case, n: int, device: torch.device, generator: torch.Generator,
         sample_fn: SampleFn | None = None) -> np.ndarray:
    """n draws per row -> int64 [n, rows], drawn in large repeated batches. The sampler's draw is a deterministic
    function of each row's uniform, so every repeated row gets a fresh uniform from the grid's own generator."""
    rows, vocab = case.logits.shape
    sampler = Sampler(device, vocab)
    sample_fn = sample_fn or sampler.sample
    reps = max(1, min(n, (CHUNK_ELEMENTS << (4 if device.type == "cuda" else 0)) // (rows * vocab)))
    args = _tile(sampler.prepare(make_batch(case.params)), reps)
    logits = torch.from_numpy(case.logits).to(device).repeat(reps, 1)
    chunks = []
    for _ in range(-(-n // reps)):
        if args.temperatures is not None:
            args.uniforms = torch.rand(reps * rows, dtype=torch.float64, device=device, generator=generator)
        chunks.append(sample_fn(logits, args).view(reps, rows).cpu())
    return torch.cat(chunks)[:n].numpy().astype(np.int64)


def _oracles(case: Case) -> List[oracle.Filtered]:
    out = [oracle.filtered_distribution(row, p.temperature, p.top_k, p.top_p, p.min_p)
           for row, p in zip(case.logits, case.params)]
    for i, f in enumerate(out):
        if f.margin < MIN_MARGIN:
            raise ValueError(f"case {case.name} row {i}: a threshold lies {f.margin:.1e} from the mass it is "
                             "compared with, too close for a float32 sampler to decide reliably; move it")
    return out


def _is_random(f: oracle.Filtered) -> bool:
    return f.probs is not None and int((f.probs > 0).sum()) >= 2


def _required(f: oracle.Filtered, alpha: float, tv: float, power: float) -> int | None:
    return required_draws(f.probs[f.probs > 0], alpha, tv, power) if _is_random(f) else None


def _check_row(case: Case, i: int, f: oracle.Filtered, draws: np.ndarray, alpha: float, tv: float,
               power: float) -> RowResult:
    params = case.params[i]
    res = RowResult(case.name, i, describe(params), "sampled", len(draws), alpha, _required(f, alpha, tv, power))
    if f.probs is None:
        res.kind, res.outside = "invalid", int((draws != -1).sum())
    elif not _is_random(f):  # greedy, or a support of one token
        res.kind = "greedy" if params.is_greedy else "single"
        res.outside = int((draws != int(np.argmax(f.probs))).sum())
    else:
        support = np.flatnonzero(f.probs > 0)
        counts = np.bincount(np.clip(draws, -1, case.vocab) + 1, minlength=case.vocab + 2)[1:-1]
        res.outside = len(draws) - int(counts[support].sum())
        fit = chi_square(counts[support], f.probs[support])
        df = max(fit.categories - 1, 1)
        res.categories, res.statistic, res.p_value = fit.categories, fit.statistic, fit.p_value
        res.pooled_mass = fit.pooled_mass
        res.detectable_tv = detectable_tv(len(draws), df, alpha, power)
        res.power_at_tv = power_at(len(draws), df, alpha, tv)
    res.passed = res.outside == 0 and (res.p_value is None or res.p_value >= alpha)
    if res.outside:
        res.note = f"{res.outside} draws outside the oracle's answer"
    elif not res.passed:
        res.note = "chi-square rejects"
    return res


def run_grid(device: str = "cpu", sample_fn: SampleFn | None = None, cases: Sequence[Case] | None = None,
             family_alpha: float = 0.01, tv: float = 0.01, power: float = 0.99,
             max_cost: float | None = None, seed: int = 0,
             on_case: Callable[[str, bool, float], None] | None = None) -> GridResult:
    """Run every case; sample_fn replaces Sampler.sample (to test another implementation, or a planted fault);
    on_case(name, passed, seconds) as each case ends."""
    cases = list(cases) if cases is not None else all_cases()
    dev = torch.device(device)
    max_cost = max_cost if max_cost is not None else DEFAULT_MAX_COST[dev.type]
    oracles = {c.name: _oracles(c) for c in cases}
    n_tests = max(1, sum(_is_random(f) for fs in oracles.values() for f in fs))
    alpha = family_alpha / n_tests
    rows: List[RowResult] = []
    seconds: Dict[str, float] = {}
    for case in cases:
        fs = oracles[case.name]
        needed = [n for f in fs if (n := _required(f, alpha, tv, power)) is not None]
        n = min(max(needed, default=GREEDY_ONLY_DRAWS), max(1, int(max_cost // case.vocab)))
        gen = torch.Generator(dev).manual_seed(seed * 1_000_003 + zlib.crc32(case.name.encode()))
        start = time.perf_counter()
        try:
            draws = draw(case, n, dev, gen, sample_fn)
        except Exception as e:  # a crashing sampler fails the case; the report says how
            case_rows = [RowResult(case.name, i, describe(p), "error", 0, alpha, passed=False,
                                   note=f"{type(e).__name__}: {e}") for i, p in enumerate(case.params)]
        else:
            case_rows = [_check_row(case, i, f, draws[:, i], alpha, tv, power) for i, f in enumerate(fs)]
        seconds[case.name] = time.perf_counter() - start
        rows += case_rows
        if on_case is not None:
            on_case(case.name, all(r.passed for r in case_rows), seconds[case.name])
    settings = {"family_alpha": family_alpha, "tests": n_tests, "per_test_alpha": alpha, "tv": tv, "power": power,
                "max_cost": max_cost, "seed": seed}
    return GridResult(rows, settings, seconds)


# --------------------------------------------------------------------------------------------------------- CLI
def run_cli(device: str = "cpu", out: Path | None = None, seed: int = 0, max_cost: float | None = None,
            real_models: Sequence[ModelRef | str] = REAL_MODELS, update: bool = False) -> GridResult:
    """Run the grid with a line per case as it ends, write the report (under `out`, else the report root: the
    committed reports/ only when `update`), print a short table and the verdict."""
    start = time.perf_counter()
    result = run_grid(device, cases=all_cases(real_models), max_cost=max_cost, seed=seed,
                      on_case=lambda name, passed, secs: progress.line("sampling", f"{device} {name}",
                                                                       "PASS" if passed else "FAIL", secs))
    wall = time.perf_counter() - start
    out = out or report.report_root(update) / "sampling" / device.split(":")[0]
    write_report(result, device, out, wall)
    print(report.text_table(table_rows(result), ["case", "row", "params", "n", "categories", "p_value",
                                                 "detectable_tv", "power_at_tv", "result"]))
    s = result.settings
    print(f"\n{s['tests']} chi-square tests at alpha {s['per_test_alpha']:.2e} each (family {s['family_alpha']}); "
          f"{wall:.0f} s")
    print(report.written_to(out / "sampling.md", update))
    print("PASS" if result.passed else f"FAIL: {', '.join(result.failed_cases())}")
    return result


def main_from_parity(update: bool = False, real_models: Sequence[ModelRef | str] = REAL_MODELS) -> GridResult:
    """What `python -m harness parity` runs after the golden comparison: the default CPU grid and its report (its
    real-logit cases on the models parity was given, where they are folders of the user's own)."""
    return run_cli("cpu", real_models=real_models, update=update)


def command(args: argparse.Namespace) -> int:
    if args.engine != "engine":
        from harness.sampling.subject import command as through_engine

        return through_engine(args)
    check_device(args.device, flashinfer=args.device.startswith("cuda"))  # on CUDA the grid tests FlashInfer's filters
    if args.max_cost is not None and args.max_cost <= 0:
        raise UserError(f"--max-cost {args.max_cost:g} allows no draw; give a positive number of draws x vocab, "
                        "e.g. 2.5e8")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} is a file; give a folder for the report")
    junit.check_path(args.junit)
    models = []
    if not args.no_real:  # before the grid: a model this machine cannot get ends the run now, in one line
        try:
            models = resolve_models(args, REAL_MODELS, verb="a real-logit case")
        except UserError as e:
            raise UserError(f"{e}, or leave its cases out (--real-model with the others, or --no-real)") from e
    result = run_cli(args.device, Path(args.out) if args.out else None, args.seed, args.max_cost, models,
                     args.update_reports)
    if args.junit:
        print(f"junit: {junit.write(args.junit, [junit.sampling_suite(result, args.device)])}")
    return EXIT_PASS if result.passed else EXIT_FINDING
