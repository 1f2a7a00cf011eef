"""Scheduler faults planted in the driver's source (harness/driver.py), for the step-budget policy's test and the
serving gate's (tests/test_step_budget.py, tests/test_serving.py): each an edit of one line, applied to a copy.

- chunk-ignores-budget: a mixed step's chunk is cut at the step's tokens only, not at the budget's allowance (a long
  prompt's chunk as long as the forward allows, whatever it costs beside the decodes).
- decodes-starved: a step after one that carried a chunk leaves the running requests out (they wait a step), and, with
  nothing decoding in it, carries prompt work as an unbudgeted prefill.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
PATCHES = {
    "chunk-ignores-budget": ("            limit = self.budget.chunk(allowance, start, limit)\n",
                             "            pass  # planted: the chunk ignores the step budget\n"),
    "decodes-starved": ("            step = self._prefill_step(waiting, running, decoding, on_logits, t0)\n",
                        "            step = self._prefill_step(waiting, running, [] if yield_to_decode else decoding, "
                        "on_logits, t0)  # planted\n"),
}


def planted_source(fault: str) -> str:
    old, new = PATCHES[fault]
    source = (REPO / "harness" / "driver.py").read_text()
    assert source.count(old) == 1, f"the {fault} patch no longer matches harness/driver.py"
    return source.replace(old, new)


def planted_driver(fault: str, folder: Path) -> type:
    """The Driver class of a copy of harness/driver.py with the fault planted (a module of its own)."""
    path = folder / f"driver_{fault.replace('-', '_')}.py"
    path.write_text(planted_source(fault))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.Driver


def planted_tree(fault: str, dest: Path) -> Path:
    """A copy of this tree's engine/ and harness/ with the fault planted in its driver: another revision."""
    for part in ("engine", "harness"):
        shutil.copytree(REPO / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "harness" / "driver.py").write_text(planted_source(fault))
    return dest
