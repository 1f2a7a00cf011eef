"""The same work in several fresh processes: every position's log-probabilities and every token bitwise the same in
each (the engine's promise: the same inputs and configuration give the same bits in every process).

A fresh process lays its memory out anew (addresses, alignment) and initialises its libraries anew (the BLAS's
kernel choices, thread pools): what follows an address, an allocation or a one-time choice differs between processes
and nowhere else, so no check within one process sees it. tests/test_process_determinism.py searches model shapes
and workloads with it; the fuzzer's process-twin run is its one-process-pair form.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List

from harness.fuzz.case import Failure
from harness.fuzz.engines import EngineWorker
from harness.fuzz.invariants import compare_bitwise
from harness.fuzz.runs import RunOutput, RunSpec
from harness.models import ModelRef


def run_in_processes(model: ModelRef, kwargs: Dict[str, Any], spec: RunSpec, processes: int = 3,
                     threads: int | None = None, plant: str | None = None) -> List[RunOutput]:
    """spec on an engine of kwargs, once in each of `processes` newly started processes, one after another (so none
    competes with another for the cores), at `threads` (None: the engine's own count, as parity runs it); plant: a
    planted fault in each (harness.fuzz.faults)."""
    outs = []
    for i in range(processes):
        worker = EngineWorker(f"process-{i}", model, threads=threads, plant=plant)
        try:
            worker.configure(kwargs)
            outs.append(worker.run(spec))
        finally:
            worker.close()
    return outs


def first_difference(outs: List[RunOutput], counts: Counter | None = None) -> Failure | None:
    """The first process whose run is not bitwise the first's, as a Failure naming where (None: all the same)."""
    for i, out in enumerate(outs[1:], 1):
        failure = compare_bitwise(outs[0], out, "process", f"process {i}", counts if counts is not None else Counter())
        if failure is not None:
            return Failure(failure.invariant, failure.stage, f"against process 0: {failure.details}")
    return None
