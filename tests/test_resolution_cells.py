"""The committed resolution table (reports/resolution/cells.json, `python -m harness resolution --cells`): a row for
every committed CPU golden cell of golden/ (the goldens CI's gate runs; `nox -s resolution-cells` measures them), each
with the four engine families searched and a verdict against its goal; every other committed cell (a GPU's, a
long-context golden's) has a row or is listed as not measured yet with its command, so that the table never hides a
golden whose gate no one has measured."""

from __future__ import annotations

import json

from harness.models import GOLDEN_DIR
from harness.resolution import cells as C

TABLE = GOLDEN_DIR.parent / "reports" / "resolution" / "cells.json"


def test_every_committed_golden_cell_has_a_row_or_is_named_as_not_measured():
    table = json.loads(TABLE.read_text())
    rows = {r["cell"]: r for r in table["cells"]}
    cells = C.committed()
    assert len(cells) == len(list(GOLDEN_DIR.glob("**/provenance.json")))
    cpu_missing = [c.key for c in cells if c.device == "cpu" and c.golden_root == GOLDEN_DIR and c.key not in rows]
    assert not cpu_missing, f"no resolution row for {cpu_missing}: python -m harness resolution --cells"
    assert [p["cell"] for p in table["pending"]] == [c.key for c in cells if c.key not in rows], \
        "the table's list of cells not measured yet is stale: run python -m harness resolution --cells on a device"
    assert set(rows) <= {c.key for c in cells}, "a row for a golden that is no longer committed"
    for cell in cells:
        if cell.key in rows:
            row = rows[cell.key]
            assert set(row["families"]) == set(C.FAMILY_ORDER), (cell.key, row["families"])
            assert row["verdict"].startswith(("meets", "misses")) and row["measured"]["git_commit"], row


def test_the_verdict_follows_the_goal():
    def fams(e):
        return {f: {"smallest_detected": e, "largest_missed": None, "status": "bracketed"} for f in C.FAMILY_ORDER}

    assert C.verdict("float32", fams(5e-6), 1e-3).startswith("meets")
    assert C.verdict("float32", fams(3e-4), 1e-3).startswith("misses softmax-decode, softmax-prefill, rope-base")
    assert C.verdict("bfloat16", fams(0.03), 5.0).startswith("meets")
    assert C.verdict("bfloat16", fams(None), 303.0).startswith("misses")
