"""The checks whose resolution is measured, each as a probe: plant a fault, run only what the check runs, say
whether it fails.

- ParityCheck: the parity gate of one (model, device, dtype) on one path, against the committed golden, run
  in-process on one engine kept across probes (a fault that graphs bake gets an engine built inside it).
- SamplingCheck: the sampling grid's chi-square and exact checks on a stated subset of its cases.
Checks built elsewhere (the component checks, the fuzzer) join through adapters.py.
"""

from __future__ import annotations

from typing import Dict, List, Protocol, Sequence, Tuple

import torch

from engine import Engine
from harness import UserError
from harness import golden as G
from harness.compare import ROUTER_TIE
from harness.parity.gate import HALF, PathResult, PromptResult, dist_limits, evaluate, tie_tolerance, tolerance
from harness.parity.paths import PATHS
from harness.models import ModelRef, name_of
from harness.parity.run import drive_path, model_is_moe, path_engine, plan_path
from harness.resolution.faults import Family, Target
from harness.resolution.search import Verdict


class Check(Protocol):
    name: str
    target: Target  # the families it is measured on: engine faults or sampler faults
    families: Tuple[str, ...] | None  # the families of that target it can be probed with (None: all)

    def describe(self) -> str:
        """What runs in one probe, for the report."""

    def search_range(self, family: Family) -> tuple[float, float]:
        """(e_min, e_max) of the search for this family."""

    def baseline(self) -> Verdict:
        """The check with no fault planted (must pass, or no resolution is defined)."""

    def probe(self, family: Family, e: float) -> Verdict:
        """The check with the family's fault of size e planted."""

    def close(self) -> None:
        """Release what the check holds (its engine)."""


class WholeRunCheck:
    """A check that runs all of itself again in every probe (`_run`), its fault planted around the whole run, over
    each family's own search range."""

    def search_range(self, family: Family) -> tuple[float, float]:
        return family.e_min, family.e_max

    def baseline(self) -> Verdict:
        return self._run()

    def probe(self, family: Family, e: float) -> Verdict:
        with family.plant(e, None):
            return self._run()

    def close(self) -> None:
        pass

    def _run(self) -> Verdict:
        raise NotImplementedError


class ParityCheck:
    """harness.parity's gate for one model, device and dtype on one path, every golden prompt."""

    target: Target = "engine"
    families = None

    def __init__(self, model: ModelRef | str, device: str = "cpu", dtype: str = "float32", path: str = "batch",
                 threads: int = 1) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.threads = threads  # CPU threads for the probes: the engine sets its own (its physical cores) when built
        self.name = f"parity {dtype} {name_of(model)} ({path})"
        chosen = [p for p in PATHS if p.name == path]
        if not chosen or not chosen[0].applies_to(device):
            names = ", ".join(p.name for p in PATHS if p.applies_to(device))
            raise UserError(f"parity path {path!r} does not run on {device}; choose one of: {names}")
        self.path = chosen[0]
        self.gs = G.load_checked(model, device.split(":")[0], dtype)
        self.moe = model_is_moe(model)
        self.tol, self.limits = tolerance(self.gs, dtype, self.moe), dist_limits(self.gs, dtype, self.moe)
        self.tie_tol = tie_tolerance(self.tol, self.limits)
        self.plan = plan_path(self.path, device, dtype, self.gs)
        self.engine: Engine | None = None
        self.builds = 0  # engines built: one, plus one per probe of a fault the graphs bake
        self.layers = 0  # the model's, once an engine is built
        self._baked: Dict[str, bool] = {}

    def describe(self) -> str:
        gate = f"max err per prompt <= {self.tol:.3g}" + (
            "" if self.limits is None else ", " + ", ".join(f"{k} <= {v:.3g}" for k, v in self.limits.items()))
        tokens = sum(len(p.prompt_ids) + len(p.tokens) - 1 for p in self.gs.prompts)  # the last token is not fed
        writes = f" ({tokens * self.layers} KV writes: tokens x layers)" if self.layers else ""
        return (f"path `{self.path.name}` ({self.path.description}), {len(self.gs.prompts)} golden prompts "
                f"teacher-forced, {len(self.gs.prompts[0].tokens)} new tokens each{writes}; gate: {gate}, near ties "
                f"within {self.tie_tol:.3g}")

    def search_range(self, family: Family) -> tuple[float, float]:
        half = self.dtype in HALF and family.e_min_half is not None
        return (family.e_min_half if half else family.e_min), family.e_max

    def baked(self, family: Family) -> bool:
        if family.name not in self._baked:
            self._baked[family.name] = family.baked(self._live())
        return self._baked[family.name]

    def baseline(self) -> Verdict:
        return self._run(self._live())

    def probe(self, family: Family, e: float) -> Verdict:
        if self.baked(family):
            self.close()  # one engine per process: the clean one is rebuilt when next needed
            with family.plant(e, None) as planted:
                engine = self._build()
                try:
                    return _with(self._run(engine), planted)
                finally:
                    engine.shutdown()
        engine = self._live()
        with family.plant(e, engine) as planted:
            return _with(self._run(engine), planted)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ---------------------------------------------------------------------------------------------- internals
    def _build(self) -> Engine:
        self.builds += 1
        engine = path_engine(self.plan, self.model)
        self.layers = engine.config.model_config.num_layers
        torch.set_num_threads(self.threads)
        return engine

    def _live(self) -> Engine:
        if self.engine is None:
            self.engine = self._build()
        return self.engine

    def _run(self, engine: Engine) -> Verdict:
        _zero_pool(engine)  # every probe starts from the pool a new engine has: no KV of an earlier probe
        stats, outputs, margins = drive_path(engine, self.plan, self.gs)
        prompts, path_result = evaluate(self.path, self.gs, stats, outputs, self.tol, self.tie_tol, self.limits,
                                        margins if self.moe else None, ROUTER_TIE[self.dtype] if self.moe else 0.0)
        return _verdict(prompts, path_result, self.tol)


def _with(verdict: Verdict, planted: object) -> Verdict:
    """The verdict, with what the fault reported doing (the KV fault: how many writes it lost)."""
    return verdict if planted is None else Verdict(verdict.detected, f"{verdict.detail}; {planted}")


def _zero_pool(engine: Engine) -> None:
    for layer in range(engine.config.model_config.num_layers):
        engine.kv_cache.k_cache(layer).zero_()
        engine.kv_cache.v_cache(layer).zero_()


def _verdict(prompts: List[PromptResult], path: PathResult, tol: float) -> Verdict:
    failed = [p for p in prompts if not p.passed]
    worst = max(prompts, key=lambda p: max(p.max_err_prefill, p.max_err_decode))
    err = max(worst.max_err_prefill, worst.max_err_decode)
    parts = [f"{failed[0].prompt}: {failed[0].reason}" + (f" (+{len(failed) - 1} prompts)" if len(failed) > 1 else "")
             if failed else f"max err {err:.3g} of tol {tol:.3g} ({worst.prompt})"]
    if path.limits is not None:
        parts.append(path.reason if not path.passed else
                     ", ".join(f"{k} {path.stats[k]:.3g}/{v:.3g}" for k, v in path.limits.items() if k in path.stats))
    return Verdict(bool(failed) or not path.passed, "; ".join(parts))


# ---------------------------------------------------------------------------------------------- sampling
# The grid's small cases with random rows under every filter; the real-logit and support-only cases are left out
# (their chi-square tests cost 100 x more a probe and test the same rules).
SAMPLING_CASES = ("temperature", "top-k", "top-p", "top-k+top-p", "min_p", "per-row")


class SamplingCheck(WholeRunCheck):
    """harness.sampling's grid (exact checks and chi-square at stated power) on a subset of its cases."""

    target: Target = "sampler"
    families = None

    def __init__(self, device: str = "cpu", cases: Sequence[str] = SAMPLING_CASES, family_alpha: float = 0.01,
                 tv: float = 0.01, power: float = 0.99, seed: int = 0) -> None:
        from harness.sampling.cases import small_cases

        by_name = {c.name: c for c in small_cases()}
        unknown = [c for c in cases if c not in by_name]
        if unknown:
            raise ValueError(f"unknown sampling cases {unknown}; choose from: {', '.join(by_name)}")
        self.device, self.cases = device, [by_name[c] for c in cases]
        self.settings = dict(family_alpha=family_alpha, tv=tv, power=power, seed=seed)
        self.name = f"sampling grid ({len(self.cases)} cases)"
        self._last: Dict[str, float] = {}
        self._draws: tuple[int, int] | None = None

    def describe(self) -> str:
        s = self._last or self.settings
        alpha = f", {s['tests']} chi-square tests at {s['per_test_alpha']:.2e} each" if "tests" in s else ""
        draws = f" ({self._draws[0]}-{self._draws[1]} draws a row)" if self._draws else ""
        return (f"cases {', '.join(c.name for c in self.cases)}; family alpha {s['family_alpha']}{alpha} "
                f"(Bonferroni); the power analysis sizes each case for total variation {s['tv']} at power "
                f"{s['power']}{draws}; seed {s['seed']}, the same draws' uniforms in every probe")

    def _run(self) -> Verdict:
        from harness.sampling.run import run_grid

        result = run_grid(self.device, cases=self.cases, **self.settings)
        self._last = result.settings
        tested = [r for r in result.rows if r.p_value is not None]
        self._draws = min(r.n for r in tested), max(r.n for r in tested)
        low = min(tested, key=lambda r: r.p_value)
        failed = [r for r in result.rows if not r.passed]
        detail = (f"{len(failed)} rows fail, first {failed[0].case} row {failed[0].row} ({failed[0].params}): "
                  f"{failed[0].note}" if failed else
                  f"lowest p {low.p_value:.2g} ({low.case} row {low.row}) against alpha {low.alpha:.2g}")
        return Verdict(not result.passed, detail)
