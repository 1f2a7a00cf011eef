"""Checks built elsewhere, as resolution probes: the component checks (harness/components) and the fuzzer
(harness/fuzz).

- ComponentCheck: every case of the component grid a family's fault lives in, each with the components' own fault
  of size e planted in the kernel under test only (its reference and the float64 result never see it): detected when
  any case fails. On CUDA the kernel is FlashInfer's; on the CPU the torch implementation stands on both sides, which
  measures the resolution of the measure itself (kernel error within ERROR_FACTOR x the reference's).
- FuzzCheck: a fuzz run of a fixed budget and seed with this package's fault planted in this process, where the
  engine under test lives (the fuzzer's reference and eager-twin engines run in processes of their own and stay
  correct): detected when the run reports a broken invariant.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from harness.models import ModelRef, name_of
from harness.resolution.faults import Family, Target
from harness.resolution.checks import WholeRunCheck
from harness.resolution.search import Verdict

# family -> (component check, phases of its cases, the components' fault kind)
COMPONENT_FAULTS: Dict[str, Tuple[str, Tuple[str, ...], str]] = {
    "softmax-decode": ("attention", ("decode", "graph"), "softmax_scale"),
    "softmax-prefill": ("attention", ("prefill", "extend"), "softmax_scale"),
    "kv-wrong-slot": ("kv_append", ("prefill", "extend", "decode", "graph"), "kv_slot"),
    "rope-base": ("rope", (), "rope_base"),
}


class ComponentCheck:
    target: Target = "engine"
    families = tuple(COMPONENT_FAULTS)

    def __init__(self, device: str = "cpu") -> None:
        from harness.components import attention_cases, check_attention, check_kv_append, check_op, op_cases

        self.device = device
        self.kernel = "flashinfer" if device.startswith("cuda") else "torch"
        self.name = f"components ({self.kernel} against torch)"
        graph = device.startswith("cuda")  # the graph phase captures FlashInfer's decode
        runs: Dict[str, Callable] = {"attention": check_attention, "kv_append": check_kv_append}
        self._cases: Dict[str, List[Tuple[Callable, object]]] = {}
        for family, (check, phases, _) in COMPONENT_FAULTS.items():
            if check == "rope":
                self._cases[family] = [(check_op, c) for c in op_cases() if c.op in ("rope", "qk_rope_store")]
            else:
                self._cases[family] = [(runs[check], c) for c in attention_cases()
                                       if c.phase in phases and (graph or c.phase != "graph")]

    def describe(self) -> str:
        from harness.components import ERROR_FACTOR

        counts = ", ".join(f"{f}: {COMPONENT_FAULTS[f][0]} on {len(cs)} cases" for f, cs in self._cases.items())
        return (f"the component grid on {self.device} ({counts}); a numeric case fails when the kernel's max or mean "
                f"error against float64 exceeds {ERROR_FACTOR:g} x the torch reference's, the KV append when any "
                "element differs; the components' own fault is planted in the kernel under test")

    def search_range(self, family: Family) -> Tuple[float, float]:
        return family.e_min, family.e_max

    def baseline(self) -> Verdict:
        return self._run(list(self._cases), None)

    def probe(self, family: Family, e: float) -> Verdict:
        return self._run([family.name], e)

    def close(self) -> None:
        pass

    def _run(self, families: List[str], e: float | None) -> Verdict:
        from harness.components import Fault

        worst = None
        for family in families:
            fault = None if e is None else Fault(COMPONENT_FAULTS[family][2], e)
            for check, case in self._cases[family]:
                result = check(case, self.device, self.kernel, fault)
                if not result.passed:
                    return Verdict(True, _component_detail(result))
                if worst is None or result.worst_ratio > worst.worst_ratio:
                    worst = result
        return Verdict(False, f"worst error ratio {worst.worst_ratio:.2f} ({worst.check} {worst.case})")


def _component_detail(result) -> str:
    if any(result.mismatches.values()):
        return f"{result.check} {result.case}: {sum(result.mismatches.values())} elements differ"
    return f"{result.check} {result.case}: error ratio {result.worst_ratio:.2f}"


class FuzzCheck(WholeRunCheck):
    """The fuzzer on tiny-qwen3 (its default model). The engine under test is built inside every probe (graphs
    bake some faults), the fuzzer's hypothesis database is private to the check (examples failing under a planted
    fault stay out of the user's), and the workers it compares with are kept across probes."""

    target: Target = "engine"
    # class-level faults only: the rope-base fault rewrites a built engine's tables, and the fuzzer builds its own
    families = ("softmax-decode", "kv-wrong-slot")

    def __init__(self, device: str = "cpu", model: ModelRef | str = "tiny-qwen3", budget: float = 20.0,
                 seed: int = 0) -> None:
        from harness import golden as G
        from harness.fuzz.strategies import dtypes

        for dtype in dtypes(device, None):  # the fuzzer's tolerance: a missing golden is refused before any run
            G.load_checked(model, device.split(":")[0], dtype)
        self.device, self.model, self.budget, self.seed = device, model, budget, seed
        self.name = f"fuzz {name_of(model)} ({budget:g} s a probe)"
        self.evaluator = None  # its worker processes start with the first probe
        self._folder = tempfile.TemporaryDirectory(prefix="resolution-fuzz-")
        self._cases: List[int] = []

    def describe(self) -> str:
        cases = f", {min(self._cases)}-{max(self._cases)} workloads a probe" if self._cases else ""
        return (f"`harness fuzz` on {name_of(self.model)}, {self.device}, seed {self.seed}, a search budget of "
                f"{self.budget:g} s a probe (shrinking a failure takes up to half that again){cases}; detection is a "
                "random search's: the bisection assumes it monotone")

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        self._folder.cleanup()

    def _run(self) -> Verdict:
        from harness.fuzz.invariants import Evaluator
        from harness.fuzz.search import FuzzOptions, fuzz

        self.evaluator = self.evaluator or Evaluator(self.model, self.device)
        self.evaluator.host.close()  # no engine built outside this probe's fault
        try:
            result = fuzz(FuzzOptions(self.model, self.device, seed=self.seed, budget=self.budget,
                                      folder=Path(self._folder.name)), self.evaluator)
        finally:
            self.evaluator.host.close()
        self._cases.append(sum(p.cases for p in result.phases))
        if result.passed:
            return Verdict(False, f"{self._cases[-1]} workloads passed")
        f = result.case.failure
        return Verdict(True, f"{f.invariant} in {f.stage}: {f.details[:120]}")
