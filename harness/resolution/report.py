"""The resolution report: <reports>/resolution/<device>.{md,json}, <reports> being build/reports unless the
committed reports/ are asked for."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from harness.report import markdown_table, provenance, provenance_markdown, report_root, write_json, written_to
from harness.resolution.faults import FAMILIES
from harness.resolution.search import Search, Verdict


@dataclass
class Row:
    """One (check, family) cell of the table."""

    family: str
    search: Search | None  # None: not searched (the check fails with no fault)


@dataclass
class CheckResult:
    """A check's baseline and its searches, one per family."""

    kind: str
    name: str
    description: str
    baseline: Verdict
    baseline_seconds: float
    rows: List[Row] = field(default_factory=list)
    builds: int | None = None  # engines built, for checks that hold one


GOALS = (  # (family, check kind, device type, largest e that must be detected, what the goal is)
    ("softmax-decode", "parity-fp32", None, 1e-3, "0.1% in fp32"),
    ("softmax-decode", "parity-bf16", "cuda", 1e-2, "1% by a check of `pytest -m cuda`"),
    ("softmax-decode", "components", "cuda", 1e-2, "1% by a check of `pytest -m cuda`"),
)
WHY = {  # check kind -> why its gate stops where it does, and what would see further
    "parity-fp32": "its tolerance is 4 x HF's own largest sdpa-vs-eager error on the golden: a fault whose effect "
                   "stays under that is indistinguishable from a correct kernel's rounding. A check on identical "
                   "inputs against a float64 reference (one kernel, no 30 layers of amplified rounding between) would "
                   "see further.",
    "parity-bf16": "its limits are HF's own bf16 spread (sdpa against eager attention) times sqrt(3) (err p99) and 3 "
                   "(KL): a fault whose effect on the log-probabilities stays within bf16's own noise passes. A "
                   "comparison on identical inputs, where the reference's error is one kernel's bf16 rounding (the "
                   "FlashInfer-against-torch component checks, both measured against fp32), or the engine's own "
                   "torch-backend path as the reference instead of HF, would see a 1% scale error.",
    "components": "its bound is 3 x the torch reference's own error against float64 on the same inputs; a kernel "
                  "whose own bf16 error is already near that bound leaves less room for a fault to show.",
}


def _e(e: float | None) -> str:
    return "-" if e is None else f"{e:.3g}"


def _table_row(result: CheckResult, row: Row) -> Dict[str, Any]:
    s = row.search
    if s is None:
        return {"check": result.name, "family": row.family, "smallest detected": "not searched",
                "largest missed": "-", "probes": 0, "seconds": 0.0, "what the check saw at the threshold":
                f"fails with no fault: {result.baseline.detail}"}
    at = next((p for p in s.probes if p.e == s.smallest_detected), None)
    status = "" if s.status == "bracketed" else f" ({s.status})"
    return {"check": result.name, "family": row.family, "e range": f"{s.e_min:g}..{s.e_max:g}",
            "smallest detected": _e(s.smallest_detected) + status, "largest missed": _e(s.largest_missed),
            "probes": len(s.probes), "seconds": round(s.seconds, 1),
            "what the check saw at the threshold": at.detail if at else s.probes[-1].detail}


def _probes_line(row: Row) -> str:
    if row.search is None:
        return "-"
    return ", ".join(f"{p.e:.3g} {'caught' if p.detected else 'missed'}" for p in row.search.probes)


def _goals(results: List[CheckResult], device: str) -> List[str]:
    lines = []
    for fam, kind, where, need, goal in GOALS:
        if where is not None and not device.startswith(where):
            line = f"- {goal}, {fam}: a {where} goal; see reports/resolution/{where}.md"
            lines += [] if line in lines else [line]
            continue
        for r in (r for r in results if r.kind == kind):
            row = next((x for x in r.rows if x.family == fam and x.search is not None), None)
            if row is None:
                continue
            s = row.search
            got = s.smallest_detected
            if got is not None and got <= need:
                lines.append(f"- {goal}, {fam}: **met** by {r.name}, which detects e = {_e(got)}.")
                continue
            missed = next((p for p in s.probes if p.e == s.largest_missed), None)
            saw = f" At e = {missed.e:.3g} it saw: {missed.detail}." if missed else ""
            lines.append(f"- {goal}, {fam}: **not met** by {r.name}, which detects e = {_e(got)} and misses "
                         f"{_e(s.largest_missed)}.{saw} Why: {WHY[kind]}")
    return lines


KV_NOTE = ("A KV fault of size e loses about e x (the check's KV writes) writes, so a check that sees the first lost "
           "write detects e near 1 / writes: where a row's threshold sits there, one misplaced write is enough. The "
           "component KV check moves at least one token whenever e > 0, so it is detected at any e.")


METHOD = """\
## How it was found

- **Faults** (`harness/resolution/faults.py`) are planted in-process: a context manager patches what the engine
  reads at call time (the attention backends' softmax scale for one phase, every rotary table rewritten in place
  from base x (1 + e), the KV store, the sampler's arguments) and restores it bitwise on exit; e = 0 changes
  nothing (`tests/test_resolution.py` checks both, and that each family moves the logits). FlashInfer takes the
  softmax scale when a batch is planned, and a decode CUDA graph bakes it (and the KV store's ops) at capture: on an
  engine with decode graphs those two families are probed on an engine built inside the fault.
- **Probes** (`harness/resolution/checks.py`) run only what the check runs, in this process: a parity probe drives
  one path's golden prompts through one engine kept across probes (its KV pool zeroed before each, as a new
  engine's is) and applies the gate of `harness/parity/gate.py` (per-prompt max err against tol, near ties, and in half
  precision the distribution gate); a sampling probe runs the grid's exact and chi-square checks on the stated cases;
  a component probe (`adapters.py`) runs every case of the component grid the family's fault lives in, with the
  components' own fault planted in the kernel under test only; a fuzz probe runs the fuzzer for a fixed budget and
  seed with the fault planted in this process, whose engine is the one under test (the fuzzer's reference engines
  run in processes of their own).
- **Search** (`harness/resolution/search.py`): bisection of e in log space between e_min and e_max; detection is
  assumed monotone in e and checked at the ends (e_max must be detected, e_min missed, else the row says which end
  failed); it stops when largest missed / smallest detected <= the ratio. The threshold lies between the two
  columns.
"""


def markdown(results: List[CheckResult], device: str, settings: Dict[str, Any], prov: Dict[str, Any],
             wall: float) -> str:
    rows = [_table_row(r, row) for r in results for row in r.rows]
    left = settings.get("checks_left", 0)
    partial = [f"**Partial**: {left} more check(s) were to run when this was written.", ""] if left else []
    out = [f"# Resolution of the harness's checks ({device})", "", *partial,
           "The smallest fault of each family each check detects: a fault of size e is what the family says (below); "
           "the threshold lies between the columns smallest detected and largest missed. Searched with ratio "
           f"{settings['ratio']}, parity on path `{settings['path']}`, {settings['threads']} CPU thread(s), fuzz "
           f"probes of {settings['fuzz_budget_s']:g} s; wall time {wall:.0f} s.",
           "", markdown_table(rows), "## Goals", "", *(_goals(results, device) or ["- no goal's check was run"]), "",
           "## Families", "", *(f"- `{f.name}`: {f.what}" for f in FAMILIES.values()), "", KV_NOTE, "", "## Checks", ""]
    for r in results:
        base = "passes" if not r.baseline.detected else "FAILS"
        builds = f"; engines built: {r.builds}" if r.builds is not None else ""
        out.append(f"- **{r.name}**: {r.description}. With no fault it {base} ({r.baseline.detail}; "
                   f"{r.baseline_seconds:.1f} s){builds}.")
    out += ["", METHOD, "## Probes", ""]
    out += [f"- {r.name}, {row.family}: {_probes_line(row)}" for r in results for row in r.rows]
    out += ["", "## Provenance", "", provenance_markdown(prov)]
    return "\n".join(out)


def write_report(results: List[CheckResult], device: str, settings: Dict[str, Any], wall: float,
                 update: bool) -> str:
    """Write the markdown and JSON; return the line saying where they went."""
    device_type = device.split(":")[0]
    out: Path = report_root(update) / "resolution"
    prov = provenance(device)
    write_json(out / f"{device_type}.json", {"provenance": prov, "settings": settings, "wall_s": wall,
                                             "checks": [_as_json(r) for r in results]})
    (out / f"{device_type}.md").write_text(markdown(results, device, settings, prov, wall))
    return written_to(out / f"{device_type}.md", update)


def _as_json(result: CheckResult) -> Dict[str, Any]:
    data = asdict(result)
    for row, raw in zip(result.rows, data["rows"]):
        if row.search is not None:
            raw["search"].update(smallest_detected=row.search.smallest_detected,
                                 largest_missed=row.search.largest_missed, seconds=row.search.seconds)
    return data
