"""Whether a failure is the engine's every time: the failing path run again in a fresh process, its bits at the
failing prompt's positions against the failing run's. An engine that computes the same inputs differently from one
process to the next (a kernel chosen by an address or a one-time choice, docs/parity-determinism.md) fails the gate
in some processes and passes it in others; its failure block then says so instead of offering a re-run that may pass.
"""

from __future__ import annotations

import multiprocessing as mp
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List

import numpy as np

from harness import golden as G
from harness.compare import PositionStat
from harness.models import ModelRef
from harness.parity.paths import ParityPath


# What is planted in this process (a fault of harness.parity.layer_faults, say): (context-manager factory, its
# arguments), both module-level so that they travel to the fresh process by name, which plants them again: a fault
# planted on purpose is the same in every process, not a difference between them.
PLANTED: List[tuple[Callable[..., ContextManager[Any]], tuple]] = []


@contextmanager
def recorded(factory: Callable[..., ContextManager[Any]], *args: Any) -> Iterator[None]:
    """Record, while entered, that factory(*args) is planted here."""
    entry = (factory, args)
    PLANTED.append(entry)
    try:
        yield
    finally:
        PLANTED.remove(entry)


@dataclass
class Nondeterminism:
    """Where the re-run's bits part from the failing run's, for the failing prompt."""

    position: int  # the first position whose log-probabilities differ
    differing: int  # positions that differ
    compared: int
    err_failed: float  # the largest err of the prompt in the run that failed
    err_again: float  # and in the re-run

    def text(self) -> str:
        return (f"not deterministic: this path run again in a fresh process gave other bits for this prompt from "
                f"position {self.position} ({self.differing} of {self.compared} positions differ; largest err "
                f"{self.err_failed:.3g} in the run that failed, {self.err_again:.3g} in the re-run): the engine "
                "computes the same inputs differently from one process to the next, so a re-run can pass with "
                "nothing fixed (docs/parity-determinism.md)")


def _run(args: tuple) -> Dict[int, PositionStat]:
    planted, run_path, path, model, device, dtype, gs, batch_invariant, engine, uid = args
    with ExitStack() as stack:
        for factory, factory_args in planted:
            stack.enter_context(factory(*factory_args))
        stats, _, _ = run_path(path, model, device, dtype, gs, batch_invariant, engine)
    return stats[uid]


def run_again(run_path: Callable, path: ParityPath, model: ModelRef, device: str, dtype: str, gs: G.GoldenSet,
              batch_invariant: bool, engine: str, uid: int) -> Dict[int, PositionStat]:
    """run_path (harness.parity.run's, passed in: a module-level function travels to the child by name) over the
    whole golden set (the failing run's company) in a newly spawned process, with what is PLANTED here planted there:
    prompt uid's statistics by position."""
    with mp.get_context("spawn").Pool(1) as pool:
        args = (list(PLANTED), run_path, path, model, device, dtype, gs, batch_invariant, engine, uid)
        return pool.apply(_run, (args,))


def compare(failed: Dict[int, PositionStat], again: Dict[int, PositionStat]) -> Nondeterminism | None:
    """The engine's own top-K ids and log-probabilities (bits) at every position both runs produced."""
    both = sorted(failed.keys() & again.keys())
    differ = [pos for pos in both if not (np.array_equal(failed[pos].top_ids, again[pos].top_ids)
                                          and failed[pos].top_lp.tobytes() == again[pos].top_lp.tobytes())]
    if not differ and failed.keys() == again.keys():
        return None
    first = differ[0] if differ else min(failed.keys() ^ again.keys())
    return Nondeterminism(first, len(differ), len(both), max(s.err for s in failed.values()),
                          max(s.err for s in again.values()))
