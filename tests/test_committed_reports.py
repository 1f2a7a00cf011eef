"""What the committed reports say is right: no bench row faster than its floor, no machine's path, no module that
is not in the tree. Each check runs on reports/ and, planted, on a report that breaks it."""

from __future__ import annotations

import csv
import importlib
import json
import re
from pathlib import Path
from typing import Iterator, List

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"
FLOOR_SLACK = 1.05  # a row's timing noise may put it a little past its floor; more is a wrong floor
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:tmp|home|root|work|Users|mnt|private|var/folders)/[^\s`'\")|,]*")
FILE_PATH = re.compile(r"(?<![\w./-])((?:engine|harness|tests|tools|examples)/[\w./-]*\.(?:py|cu|sh))\b")
DOTTED = re.compile(r"(?<![\w./-])((?:engine|harness)(?:\.[a-z_][a-z0-9_]*)+)\b")


def _texts(root: Path) -> Iterator[Path]:
    for pattern in ("**/*.md", "**/*.json"):
        yield from sorted(root.glob(pattern))


def rows_past_floor(root: Path) -> List[str]:
    """Every bench row (bench.json and bench.csv under root/bench) whose fraction_of_floor is above the slack."""
    out = []
    for path in sorted((root / "bench").rglob("bench.json")):
        rows = json.loads(path.read_text()).get("rows", [])
        out += [f"{path}: {r['model']} {r['runner']} {r['workload']} {r.get('length')}: {r['fraction_of_floor']:.3g}"
                for r in rows if (r.get("fraction_of_floor") or 0) > FLOOR_SLACK]
    for path in sorted((root / "bench").rglob("bench.csv")):
        with path.open() as f:
            out += [f"{path}: {r['model']} {r['workload']} {r['length']}: {r['fraction_of_floor']}"
                    for r in csv.DictReader(f) if r.get("fraction_of_floor") and
                    float(r["fraction_of_floor"]) > FLOOR_SLACK]
    return out


def machine_paths(root: Path) -> List[str]:
    return [f"{p}: {m}" for p in _texts(root) for m in MACHINE_PATH.findall(p.read_text())]


def _resolves(dotted: str) -> bool:
    """harness.bench.tune_gemm (a module) or harness.parity.gate.tolerance (a name in one)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def missing_modules(root: Path, tree: Path = ROOT) -> List[str]:
    out = []
    for p in _texts(root):
        text = p.read_text()
        out += [f"{p}: {m}" for m in set(FILE_PATH.findall(text)) if not (tree / m).exists()]
        out += [f"{p}: {m}" for m in set(DOTTED.findall(text)) if not m.endswith(".py") and not _resolves(m)]
    return out


def test_no_committed_bench_row_is_faster_than_its_floor() -> None:
    assert rows_past_floor(REPORTS) == []


def test_no_committed_report_holds_a_machine_path() -> None:
    assert machine_paths(REPORTS) == []


def test_every_module_a_committed_report_names_is_in_the_tree() -> None:
    assert missing_modules(REPORTS) == []


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A report folder with one of each fault: gemma3-270m's 512-token CPU prefill at 2.22 of its floor (the floor
    that counted the LM head on every prompt token), a temporary worktree's path, a module since moved."""
    bench = tmp_path / "bench" / "cpu" / "gemma3-270m"
    bench.mkdir(parents=True)
    row = {"model": "gemma3-270m", "runner": "engine", "workload": "prefill", "length": 512, "fraction_of_floor": 2.22}
    (bench / "bench.json").write_text(json.dumps({"rows": [row, dict(row, length=32, fraction_of_floor=0.64)]}))
    (bench / "bench.csv").write_text("model,runner,workload,length,fraction_of_floor\n"
                                     "gemma3-270m,engine,prefill,512,2.22\ngemma3-270m,engine,prefill,32,0.64\n")
    (tmp_path / "against.md").write_text("- tree: `/tmp/bench-against-rt5a94mo/tree`\n")
    (tmp_path / "sampling.md").write_text("- **Oracle** (`harness/oracle.py`), `harness.sampling.oracle`, "
                                          "`harness.parity.gate.no_such_rule`\n")
    return tmp_path


def test_the_checks_find_each_planted_fault(planted: Path) -> None:
    assert len(rows_past_floor(planted)) == 2  # the JSON row and the CSV row, not the row under its floor
    assert machine_paths(planted) == [f"{planted / 'against.md'}: /tmp/bench-against-rt5a94mo/tree"]
    assert sorted(m.split(": ")[1] for m in missing_modules(planted)) == ["harness.parity.gate.no_such_rule",
                                                                         "harness/oracle.py"]
