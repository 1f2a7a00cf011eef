"""The resolution of every committed golden cell: each (golden set, model, device, dtype) the project ships a golden
for, its parity gate on the batch path against the four engine fault families, one row a cell in one table
(reports/resolution/cells.{md,json}) that runs on each device add to: a run replaces the rows of the cells it
measured and keeps the others, each row with the machine, commit and date it was measured on.

Goals (issue 70): fp32 parity sees a softmax-scale or RoPE-base error of 1e-4 or less; bf16 parity sees 5% or less
end to end. A cell that misses its goal says why (its tolerance and where it comes from) and what would see it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

from harness.models import GOLDEN_DIR
from harness.report import markdown_table, provenance, report_root, write_json, written_to

LONG_CONTEXT = GOLDEN_DIR / "long-context"
GOALS = {"float32": 1e-4, "bfloat16": 0.05}  # the largest e of the scale and RoPE families a cell's gate must see
GOAL_FAMILIES = ("softmax-decode", "softmax-prefill", "rope-base")
FAMILY_ORDER = ("softmax-decode", "softmax-prefill", "rope-base", "kv-wrong-slot")


@dataclass(frozen=True)
class Cell:
    model: str
    golden_root: Path
    device: str  # cpu | cuda
    dtype: str

    @property
    def key(self) -> str:
        """golden/<model>/<device>-<dtype>, or golden/long-context/...: where its golden lives."""
        return str((self.golden_root / self.model / f"{self.device}-{self.dtype}").relative_to(GOLDEN_DIR.parent))


def committed(device: str | None = None) -> List[Cell]:
    """Every golden cell in the repository (of one device type, if given), the long-context goldens included."""
    cells = []
    for root in (GOLDEN_DIR, LONG_CONTEXT):
        for prov in sorted(root.glob("*/*-*/provenance.json")):
            kind, dtype = prov.parent.name.split("-", 1)
            if device is None or kind == device:
                cells.append(Cell(prov.parent.parent.name, root, kind, dtype))
    return cells


def verdict(dtype: str, rows: Dict[str, Dict[str, Any]], tol: float) -> str:
    """Whether the cell meets its goal, or why not and what would see it."""
    goal = GOALS[dtype]
    missed = [f for f in GOAL_FAMILIES if f in rows and (rows[f]["smallest_detected"] is None
                                                         or rows[f]["smallest_detected"] > goal)]
    if not missed:
        return f"meets: every scale and RoPE error of {goal:g} or more is seen"
    what = ("the component checks (each kernel against the torch reference on identical inputs, both against fp32: "
            "`pytest -m cuda` tests/test_components.py) see a 1% scale error" if dtype != "float32" else
            "a check on identical inputs against float64 (one kernel, no amplified rounding between)")
    return (f"misses {', '.join(missed)}: the gate's tolerance {tol:.3g} (4 x HF's own largest error, or the dtype's "
            f"floor) lets an error of that effect pass as rounding; what would see it: {what}")


def row(cell: Cell, result: Any, tol: float) -> Dict[str, Any]:
    """The table's row of a cell from its resolution.report.CheckResult."""
    families = {}
    for r in result.rows:
        s = r.search
        families[r.family] = ({"smallest_detected": s.smallest_detected, "largest_missed": s.largest_missed,
                               "status": s.status} if s is not None else
                              {"smallest_detected": None, "largest_missed": None, "status": "not searched: fails "
                               f"with no fault ({result.baseline.detail})"})
    prov = provenance(cell.device)
    return {"cell": cell.key, "model": cell.model, "device": cell.device, "dtype": cell.dtype, "tol": tol,
            "families": families, "verdict": verdict(cell.dtype, families, tol),
            "measured": {k: prov.get(k) for k in ("device_name", "git_commit", "date", "torch")}}


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def markdown(rows: List[Dict[str, Any]], todo: List[Dict[str, str]]) -> str:
    """The table of rows, then the cells not measured yet (todo, pending's)."""
    table = [{"cell": r["cell"], "tol": f"{r['tol']:.3g}",
              **{f: _e(r["families"][f]["smallest_detected"]) if f in r["families"] else "not run"
                 for f in FAMILY_ORDER},
              "goal": f"{GOALS[r['dtype']]:g}", "verdict": r["verdict"],
              "measured on": f"{r['measured']['device_name']}, {r['measured']['git_commit']}, {r['measured']['date']}"}
             for r in rows]
    return "\n".join([
        "# Resolution of every golden cell", "",
        "Each committed golden cell's parity gate (path `batch`, every golden prompt) against the engine fault "
        "families of `harness/resolution/faults.py`: the smallest e each detects (the threshold lies between it and "
        "the largest e missed, within a bracket of 1.25; `-`: not detected up to the family's largest e). Made by "
        "`python -m harness resolution --cells` on each device (a run updates the rows it measured); "
        "`tests/test_resolution_cells.py` requires a row for every CPU golden of `golden/`; the cells not measured yet "
        "are listed below. Goals: fp32 sees a softmax-scale "
        "or RoPE-base error of 1e-4 or less, bf16 one of 5% or less.", "",
        markdown_table(table), ""] + ([
        "## Not measured yet", "",
        "Committed golden cells without a row: what their gate sees is unknown until this is run on their device.", "",
        *[f"- `{p['cell']}`: `{p['how']}`" for p in todo], ""] if todo else []))


def pending(rows: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    """The committed cells the table has no row for, each with the command that measures it."""
    have = {r["cell"] for r in rows}
    return [{"cell": c.key, "how": f"python -m harness resolution --cells --device {c.device} --model {c.model}"}
            for c in committed() if c.key not in have]


def write(new: List[Dict[str, Any]], update: bool) -> str:
    """Merge new rows into the table (replacing those of the same cells), rewrite it; where it went."""
    out: Path = report_root(update) / "resolution"
    path = out / "cells.json"
    old = json.loads(path.read_text())["cells"] if path.is_file() else []
    by_cell = {r["cell"]: r for r in old}
    by_cell.update({r["cell"]: r for r in new})
    rows = sorted(by_cell.values(), key=lambda r: r["cell"])
    todo = pending(rows)
    write_json(path, {"cells": rows, "pending": todo})
    (out / "cells.md").write_text(markdown(rows, todo))
    return written_to(out / "cells.md", update)
