"""python -m harness sampling --engine SPEC: another engine's sampler, seen only through its draws.

A black box's sampler cannot be handed logits, so each case is one prompt and one set of sampling parameters, and
the oracle is the float64 filtered distribution (harness.sampling.oracle) of HF's float64 logits at the prompt's
last position. The engine's own logits differ from those by its rounding (~1e-4 in log-probability in fp32, a total
variation far below what the draws can see); every threshold a case sets (top-k's k-th against the next, top-p's
crossing mass, min-p's ratio) is kept at least MARGIN clear of the one it is compared with, so that rounding cannot
move a token across it.

Where engines disagree on the rules, a case is built so that the spec's rule and the other one give distributions far
apart, and both are tested on the same draws: `order` (the spec: top-k, renormalize, then top-p over what is left;
the other: top-p over the full distribution), `min-p-temperature` (the spec: min-p against the tempered distribution;
the other: against the untempered one). The report names the rule the draws follow.

Draws: DRAWS per case by default (`--draws`), each its own request with the seed seed + i where the engine takes
seeds; the report gives the total variation each case detects with power POWER (the worst direction,
harness.sampling.stats) and the power at TARGET_TV. A case the engine refuses (a server's HTTP 4xx, a parameter it
lacks) is left out, its row saying what the engine said; the others run.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Sequence

import numpy as np

from engine.core import SamplingParams
from harness import progress, report
from harness.models import ModelRef
from harness.sampling.cases import REAL_PROMPTS, describe
from harness.sampling.oracle import filtered_distribution, softmax64
from harness.sampling.stats import chi_square, detectable_tv, power_at
from harness import UserError, subjects
from harness.subjects.base import Subject, Unsupported

if TYPE_CHECKING:
    import argparse

MARGIN = 1e-3  # relative distance of every threshold from what it is compared with
DRAWS = 2000
TARGET_TV, POWER, FAMILY_ALPHA = 0.05, 0.9, 0.01
Rule = Callable[[np.ndarray], np.ndarray]  # logits -> the distribution a rule draws from


@dataclass(frozen=True)
class Case:
    name: str
    params: SamplingParams
    rules: Dict[str, Rule]  # rule name -> distribution; the first is the spec's


@dataclass
class Row:
    model: str
    case: str
    params: str
    n: int
    alpha: float
    categories: int | None = None
    p_value: float | None = None
    detectable_tv: float | None = None
    power_at_tv: float | None = None
    outside: int = 0  # draws outside the spec's support (greedy: not the argmax)
    rules: Dict[str, float] = field(default_factory=dict)  # rule -> p-value of the draws under it
    separation: float | None = None  # total variation between the spec's rule and the other one
    follows: str = ""  # the rule the draws fit: the spec's, the other one's, or neither
    passed: bool = True
    note: str = ""
    left_out: str = ""  # what the engine said when it refused the case (the case did not run)


def hf_logits(folder: Path, prompt: str = REAL_PROMPTS[0]) -> np.ndarray:
    """HF's float64 logits [vocab] at the prompt's last position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        return model(ids).logits[0, -1].numpy()


def _spec(p: SamplingParams) -> Rule:
    return lambda lg: filtered_distribution(lg, p.temperature, p.top_k, p.top_p, p.min_p).probs


def _top_p_full(p: SamplingParams) -> Rule:
    """top-k and top-p each on the full tempered distribution, intersected (no renormalization between)."""
    def rule(lg: np.ndarray) -> np.ndarray:
        a = filtered_distribution(lg, p.temperature, top_k=p.top_k).probs > 0
        b = filtered_distribution(lg, p.temperature, top_p=p.top_p).probs > 0
        q = np.where(a & b, softmax64(lg, p.temperature), 0.0)
        return q / q.sum()
    return rule


def _min_p_untempered(p: SamplingParams) -> Rule:
    def rule(lg: np.ndarray) -> np.ndarray:
        keep = softmax64(lg, 1.0) >= softmax64(lg, 1.0).max() * p.min_p
        q = np.where(keep, softmax64(lg, p.temperature), 0.0)
        return q / q.sum()
    return rule


def _tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def _between(lo: float, hi: float) -> float | None:
    """A threshold between lo and hi (ascending) at least MARGIN (relative) from both, else None."""
    mid = (lo + hi) / 2
    return mid if hi > lo and (hi - mid) / hi >= MARGIN and (mid - lo) / mid >= MARGIN else None


def cases(logits: np.ndarray) -> List[Case]:
    """The grid on one row of logits: every threshold placed by that row's own probabilities."""
    p = np.sort(softmax64(logits, 1.0))[::-1]
    mass = np.cumsum(p)
    out = [Case(f"temperature-{t:g}", SamplingParams(temperature=t), {}) for t in (1.0, 0.7)]
    k = next(k for k in range(20, 200) if _between(p[k], p[k - 1]))  # the k-th clear of the (k+1)-th
    out.append(Case("top-k", SamplingParams(temperature=1.0, top_k=k), {}))
    top_p = _between(mass[2], mass[3])  # the crossing token is the 4th: the top 4 stay
    out.append(Case("top-p", SamplingParams(temperature=1.0, top_p=round(float(top_p), 6)), {}))
    ratios = p[:12] / p[0]  # min-p at the widest gap among the top ratios
    r = max(range(1, 11), key=lambda i: ratios[i] / ratios[i + 1])
    out.append(Case("min-p", SamplingParams(temperature=1.0, min_p=round(float(np.sqrt(ratios[r] * ratios[r + 1])),
                                                                              6)), {}))
    out.append(Case("greedy", SamplingParams(temperature=0.0), {}))
    out.append(_order_case(logits))
    out.append(_min_p_temperature_case(logits))
    for c in out:
        c.rules.setdefault("spec", _spec(c.params))
    return out


def _order_case(logits: np.ndarray) -> Case:
    """top-k then top-p, with the p at which that order and top-p over the full mass lie furthest apart."""
    best = None
    for t, k in ((t, k) for t in (1.0, 1.5) for k in (3, 5, 8, 12, 20, 50)):
        full = np.cumsum(np.sort(softmax64(logits, t))[::-1])
        p = filtered_distribution(logits, t, top_k=k).probs
        kept = np.sort(p[p > 0])[::-1]
        mass = np.cumsum(kept)
        for j in range(1, k - 1):
            top_p = _between(mass[j - 1], mass[j])
            if top_p is None:
                continue
            params = SamplingParams(temperature=t, top_k=k, top_p=round(float(top_p), 6))
            if np.min(np.abs(full - params.top_p) / params.top_p) < MARGIN:
                continue
            sep = _tv(_spec(params)(logits), _top_p_full(params)(logits))
            if best is None or sep > best[0]:
                best = (sep, params)
    params = best[1]
    return Case("order", params, {"spec": _spec(params), "top-p over the full distribution": _top_p_full(params)})


def _min_p_temperature_case(logits: np.ndarray, temperature: float = 1.5) -> Case:
    """min-p at a temperature, where the kept sets of the tempered and the untempered rule differ most."""
    tempered = np.sort(softmax64(logits, temperature))[::-1][:40]
    untempered = np.sort(softmax64(logits, 1.0))[::-1][:40]
    best = None
    for m in np.geomspace(0.02, 0.5, 60):
        m = round(float(m), 6)
        if np.min(np.abs(tempered / tempered[0] - m) / m) < MARGIN:
            continue
        if np.min(np.abs(untempered / untempered[0] - m) / m) < MARGIN:
            continue
        params = SamplingParams(temperature=temperature, min_p=m)
        sep = _tv(_spec(params)(logits), _min_p_untempered(params)(logits))
        if best is None or sep > best[0]:
            best = (sep, params)
    params = best[1]
    return Case("min-p-temperature", params, {"spec": _spec(params),
                                               "min-p against the untempered distribution": _min_p_untempered(params)})


def check_case(model: str, case: Case, logits: np.ndarray, draws: np.ndarray, alpha: float) -> Row:
    spec = case.rules["spec"](logits)
    row = Row(model, case.name, describe(case.params), len(draws), alpha)
    support = np.flatnonzero(spec > 0)
    row.outside = int((~np.isin(draws, support)).sum())
    if len(support) == 1:
        row.passed = row.outside == 0
        row.note = f"{row.outside} draws are not HF's argmax" if row.outside else ""
        return row
    for rule_name, rule in case.rules.items():
        q = rule(logits)
        keep = np.flatnonzero(q > 0)
        counts = np.bincount(np.clip(draws, 0, len(q) - 1), minlength=len(q))
        off = int((~np.isin(draws, keep)).sum())
        fit = chi_square(counts[keep], q[keep])
        row.rules[rule_name] = 0.0 if off else fit.p_value
        if rule_name == "spec":
            row.categories, row.p_value = fit.categories, fit.p_value
            df = max(fit.categories - 1, 1)
            row.detectable_tv, row.power_at_tv = detectable_tv(len(draws), df, alpha, POWER), power_at(
                len(draws), df, alpha, TARGET_TV)
    row.passed = row.outside == 0 and row.p_value >= alpha
    if len(case.rules) > 1:
        other = next(r for r in case.rules if r != "spec")
        row.separation = _tv(spec, case.rules[other](logits))
        fits = [r for r, pv in row.rules.items() if pv >= alpha]
        row.follows = ("the spec's" if fits == ["spec"] else other if fits == [other] else
                       "neither rule" if not fits else "both (the draws cannot tell them apart)")
    if not row.passed:
        row.note = (f"{row.outside} draws outside the spec's support; " if row.outside else "") + \
            ("chi-square rejects the spec's rule" if row.p_value < alpha else "")
        if row.follows and row.follows not in ("the spec's", "neither rule"):
            row.note += f"; the draws follow: {row.follows}"
    return row


def run(subject: Subject, model: ModelRef, draws: int = DRAWS, seed: int = 0,
        only: Sequence[str] = ()) -> List[Row]:
    """Every case on one model through the subject, a progress line per case."""
    from transformers import AutoTokenizer

    logits = hf_logits(model.folder)
    prompt = AutoTokenizer.from_pretrained(model.folder)(REAL_PROMPTS[0]).input_ids
    chosen = [c for c in cases(logits) if not only or c.name in only]
    alpha = FAMILY_ALPHA / max(1, sum(c.params.temperature > 0 for c in chosen))
    rows = []
    for case in chosen:
        start = time.perf_counter()
        n = draws if case.params.temperature > 0 else min(draws, 200)
        try:
            got = subject.sample(prompt, case.params, n, seed * 1_000_003 + zlib.crc32(case.name.encode()))
        except Unsupported as e:
            rows.append(Row(model.name, case.name, describe(case.params), 0, alpha, left_out=str(e)))
            progress.line("sampling", f"{model.name} {case.name}", "LEFT OUT", time.perf_counter() - start)
            continue
        rows.append(check_case(model.name, case, logits, got, alpha))
        progress.line("sampling", f"{model.name} {case.name}", "PASS" if rows[-1].passed else "FAIL",
                      time.perf_counter() - start)
    return rows


def _result(r: Row) -> str:
    if r.left_out:
        return f"left out: {r.left_out}"
    return ("pass" if r.passed else "FAIL") + (f" ({r.note})" if r.note else "")


COLUMNS = ["model", "case", "params", "n", "categories", "p_value", "alpha", "detectable_tv", "power_at_tv",
           "outside", "separation", "follows", "result"]


def write_report(rows: List[Row], spec: str, engine_info: Dict, out: Path, draws: int, wall: float,
                 seeded: bool) -> Path:
    table = [{**{k: "-" if v is None or v == "" else v for k, v in asdict(r).items()}, "result": _result(r)}
             for r in rows]
    prov = report.provenance("cpu", engine=spec, engine_provenance=engine_info)
    left = sum(bool(r.left_out) for r in rows)
    verdict = ("PASS" if all(r.passed for r in rows) else "FAIL") + (f", {left} case{'s' * (left > 1)} left out"
                                                                       if left else "")
    server = subjects.named(spec, next(iter(engine_info.values()), None))
    md = (f"# Sampling through `--engine {server}`: {verdict}\n\n{__doc__.split(chr(10), 1)[1]}\n"
          f"## Settings\n- {draws} draws per case ({'seeded' if seeded else 'unseeded: the engine takes no seed'})"
          f", greedy cases at most 200; family alpha {FAMILY_ALPHA} (Bonferroni over each model's random cases)\n"
          f"- `detectable_tv`: the total variation detected with power {POWER}; `power_at_tv`: the power at "
          f"{TARGET_TV}; `separation`: the total variation between the spec's rule and the other one\n"
          f"- wall time {wall:.0f} s\n\n## Results\n{report.markdown_table(table, COLUMNS)}\n"
          f"## Provenance\n{report.provenance_markdown(prov)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling.md").write_text(md)
    report.write_json(out / "sampling.json", {"provenance": prov, "passed": all(r.passed for r in rows),
                                              "draws": draws, "rows": [asdict(r) for r in rows]})
    return out / "sampling.md"


def command(args: "argparse.Namespace") -> int:
    """sampling --engine SPEC: the grid on each model (a subject started on that model), one report."""
    from harness import EXIT_FINDING, EXIT_PASS, junit
    from harness.models import resolve_models
    from harness.sampling.cases import REAL_MODELS

    subjects.check(args.engine)
    junit.check_path(args.junit)
    models = resolve_models(args, REAL_MODELS, verb="sampling --engine")
    start, rows, info, seeded = time.perf_counter(), [], {}, True
    for model in models:
        with subjects.open_subject(args.engine, model) as subject:
            info[model.name], seeded = subject.provenance(), subject.seeded
            rows += run(subject, model, args.draws, args.seed, args.case or ())
    if all(r.left_out for r in rows):
        raise UserError(f"--engine {args.engine} refuses every sampling case ({rows[0].left_out}); nothing to test "
                        f"its sampler on")
    out = Path(args.out) if args.out else subjects.report_dir(args.engine, args.update_reports) / "sampling"
    path = write_report(rows, args.engine, info, out, args.draws, time.perf_counter() - start, seeded)
    print(report.text_table([{k: v for k, v in asdict(r).items() if k in COLUMNS} | {"result": _result(r)}
                             for r in rows], COLUMNS))
    print(report.written_to(path, args.update_reports))
    passed = all(r.passed for r in rows)
    print("PASS" if passed else "FAIL: " + ", ".join(f"{r.model} {r.case}" for r in rows if not r.passed))
    if args.junit:
        suite = junit.Suite(f"sampling.{subjects.name(args.engine)}")
        suite.cases += [junit.TestCase(f"{suite.name}.{r.model}", f"{r.case}: {r.params}", 0.0,
                                       None if r.passed else f"sampling {r.model} {r.case} ({r.params}): {r.note}")
                        for r in rows if not r.left_out]
        print(f"junit: {junit.write(args.junit, [suite])}")
    return EXIT_PASS if passed else EXIT_FINDING
