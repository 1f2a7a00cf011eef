"""The report of `python -m harness sampling`: what was tested, how much power it had, what it found (markdown and
JSON), and the results it is made of."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence

from harness import report


@dataclass
class RowResult:
    case: str
    row: int
    params: str
    kind: str  # sampled, greedy, single (support of one token), invalid, error (the sampler raised)
    n: int
    alpha: float
    n_required: int | None = None  # draws the power analysis asks for; more than n where the cost cap binds
    # the chi-square columns stay None for rows with one right answer (greedy, single-token support, invalid)
    categories: int | None = None
    pooled_mass: float | None = None  # oracle mass merged into the tail bin: shifts inside it are invisible
    statistic: float | None = None
    p_value: float | None = None
    detectable_tv: float | None = None  # total variation detected with the target power (worst direction)
    power_at_tv: float | None = None  # power at the target total variation (worst direction)
    outside: int = 0  # draws the exact check rejects
    passed: bool = True
    note: str = ""


@dataclass
class GridResult:
    rows: List[RowResult]
    settings: Dict[str, float]
    seconds: Dict[str, float]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def failed_cases(self) -> List[str]:
        return sorted({r.case for r in self.rows if not r.passed})


METHOD = """\
## Method

- **Oracle** (`harness/sampling/oracle.py`): the filtered distribution in float64 with numpy, written from the
  specification and never calling `engine.sample`: temperature; top-k keeping every token whose probability is >=
  the k-th largest (ties with the k-th stay), renormalized; top-p keeping every token whose probability is >= that
  of the crossing token (the first, in descending order, at which the cumulative mass reaches p), so nothing
  depends on the order of equal probabilities; min_p against the full tempered distribution; the intersection,
  renormalized. Greedy rows: the argmax (lowest id among maxima).
- **The sampler's draw** is an inverse CDF read at one uniform per row; the grid hands every drawn row a fresh
  uniform from its own seeded generator. On CUDA the filters are FlashInfer's sort-free renorm kernels
  (`top_k_renorm_probs`, `top_p_renorm_probs`), on the CPU the torch filter: the same rule, tested by the same grid.
- **Exact checks** on every draw: greedy rows equal the argmax, NaN / all -inf rows give -1, and no draw falls
  outside the oracle's support. These have no false-alarm rate.
- **Chi-square** (`scipy.stats.chisquare`) per row whose support has two or more tokens, after pooling every
  token expecting < 5 draws into one tail bin (a tail still under 5 joins the smallest category). The family of
  all these tests is held at the family alpha by Bonferroni: per-test alpha = family alpha / number of tests.
- **Power.** For any alternative q at total variation d from the oracle p (on the pooled categories),
  Cauchy-Schwarz gives sum (q-p)^2/p >= (sum |q-p|)^2 / sum p = 4 d^2, with equality when the shift moves d of
  mass from categories holding half the probability to the other half, in proportion to p. That is the least
  favourable shift; the statistic is then noncentral chi-square with df = categories - 1 and noncentrality
  >= 4 N d^2, so power = P(ncx2(df, 4 N d^2) > chi2.isf(alpha, df)) is a guarantee against every shift of size d.
  N per case is the smallest count (iterated to the pooling's fixed point, since more draws split more
  categories out of the tail) giving that power at the target d for every row, unless draws x vocab exceeds the
  cost cap (the cases on real logits, 49152 or 262144 tokens): those run at the cap and report the power they
  have.
- `pooled_mass` is the oracle mass inside the tail bin; a change that only moves mass within it is not seen by
  the chi-square test (the support check still applies to every token).
"""


def _settings(result: GridResult, wall: float) -> str:
    s = result.settings
    capped = sorted({r.case for r in result.rows if r.n_required is not None and r.n < r.n_required})
    lines = [
        f"- family alpha {s['family_alpha']}, {s['tests']} chi-square tests, per-test alpha "
        f"{s['per_test_alpha']:.3e}",
        f"- target: total variation {s['tv']} detected with power >= {s['power']} in the worst direction",
        f"- cost cap: draws x vocab <= {s['max_cost']:.2e} per case; seed {s['seed']}",
        f"- wall time {wall:.1f} s; sampling time per case: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items()),
    ]
    if capped:
        lines.append(f"- below the target power (capped by cost): {', '.join(capped)}; their `detectable_tv` "
                     "column is the distance they do detect with the target power")
    return "\n".join(lines) + "\n"


def markdown(result: GridResult, table_rows: Sequence[Dict[str, Any]], columns: List[str],
             prov: Dict[str, Any], wall: float) -> str:
    verdict = "PASS" if result.passed else f"FAIL ({', '.join(result.failed_cases())})"
    return "\n".join([
        f"# Sampler distribution tests: {verdict}\n",
        _settings(result, wall),
        METHOD,
        "## Results\n",
        report.markdown_table(table_rows, columns),
        "## Provenance\n",
        report.provenance_markdown(prov),
    ])


TABLE = ["case", "row", "params", "kind", "n", "n_required", "categories", "pooled_mass", "statistic", "p_value",
         "alpha", "detectable_tv", "power_at_tv", "result"]


def table_rows(result: GridResult) -> List[Dict[str, object]]:
    return [{**{k: "-" if v is None else v for k, v in asdict(r).items()},
             "result": ("pass" if r.passed else "FAIL") + (f" ({r.note})" if r.note else "")} for r in result.rows]


def write_report(result: GridResult, device: str, out: Path, wall: float) -> None:
    prov = report.provenance(device)
    report.write_json(out / "sampling.json", {"provenance": prov, "settings": result.settings,
                                              "passed": result.passed, "seconds": result.seconds, "wall_s": wall,
                                              "rows": [asdict(r) for r in result.rows]})
    (out / "sampling.md").write_text(markdown(result, table_rows(result), TABLE, prov, wall))
