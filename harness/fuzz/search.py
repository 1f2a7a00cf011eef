"""The search: hypothesis over configurations, and for each configuration over workloads against one engine.

The outer search (hypothesis.find over harness.fuzz.strategies.configs) draws a configuration and gives it a phase:
an inner find over workloads against that configuration's engine, for a share of the budget of at most MAX_PHASE
seconds (a longer budget draws more configurations, not longer phases), in chunks of examples (find stops at
max_examples; the chunks give it a time budget). The first failure fixes the bug being shrunk (its
invariant and stage): hypothesis shrinks the workload to a minimal one failing the same way, then the outer search
shrinks the configuration, re-running only that workload and only the runs that failure needs. Shrinking gets half
the budget on top of it. Verdicts are memoized per workload and configuration, so hypothesis's replays agree.
Hypothesis's example database (build/fuzz/hypothesis) keeps failing workloads per configuration and planted fault,
and replays them first on the next run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Callable, Dict, List, Tuple

from hypothesis import HealthCheck, Phase, Verbosity, find, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import NoSuchExample

from harness.fuzz.case import Case, Failure, FuzzConfig, Past, Workload
from harness.fuzz.faults import FAULTS
from harness.fuzz.invariants import Evaluator
from harness.fuzz.strategies import configs, dtypes, workloads
from harness.models import ModelRef, name_of
from harness.report import REPO_ROOT

FUZZ_DIR = REPO_ROOT / "build" / "fuzz"
PHASES = 4  # configurations a budget is shared among at least (more when phases end early or reach MAX_PHASE)
MIN_PHASE = 15.0  # seconds
# a 20-minute CPU search in 4 phases of 300 s drew 4 configurations, all with pages of 4, the whole prefill budget and
# overlap; in phases of 60 s (about 40 cases each on a 2-core host) it draws 20
MAX_PHASE = 60.0
MAX_CHUNK = 50


@dataclass
class FuzzOptions:
    model: ModelRef | str = "tiny-qwen3"  # a zoo name, or any model (harness.models)
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    budget: float = 60.0
    planted: str | None = None
    folder: Path = FUZZ_DIR  # hypothesis/ (the example database) and cases/ (failures as JSON) under it
    batch_invariant: bool | None = None  # every configuration in batch-invariant mode, none, or drawn (None)
    long: bool = False  # the long tier: prompts past a block of 1024 pages, many chunks, deep shared prefixes


@dataclass
class PhaseStats:
    config: FuzzConfig
    cases: int = 0
    seconds: float = 0.0
    failure: Failure | None = None

    @property
    def per_minute(self) -> float:
        return 60.0 * self.cases / self.seconds if self.seconds > 0 else 0.0


@dataclass
class FuzzResult:
    options: FuzzOptions
    phases: List[PhaseStats] = field(default_factory=list)
    counts: Dict[str, int] = field(default_factory=dict)
    run_seconds: Dict[str, float] = field(default_factory=dict)  # time spent in each kind of run
    case: Case | None = None  # the minimal failing case
    first: tuple | None = None  # (config, workload) where the failure was first seen, before shrinking
    case_path: Path | None = None
    seconds: float = 0.0  # wall time, engine builds included
    setup_seconds: float = 0.0  # building engines
    shrink_seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.case is None


class _Search:
    def __init__(self, opts: FuzzOptions, evaluator: Evaluator, tick: Callable[[str], None],
                 on_phase: Callable[[int, PhaseStats], None] | None = None) -> None:
        self.opts, self.evaluator, self.tick, self.on_phase = opts, evaluator, tick, on_phase
        self.db = DirectoryBasedExampleDatabase(str(opts.folder / "hypothesis"))
        self.start = time.monotonic()
        self.setup = 0.0  # seconds spent building engines: not search, kept off the budget's clock
        self.deadline = opts.budget
        self.phase_seconds = min(max(opts.budget / PHASES, min(MIN_PHASE, opts.budget)), MAX_PHASE)
        self.shrink_seconds = opts.budget / 2
        self.failed_at: float | None = None
        self.phases: List[PhaseStats] = []
        self.config_verdicts: Dict[FuzzConfig, bool] = {}
        self.found: Dict[FuzzConfig, tuple] = {}  # config -> (workload, failure) failing like the first failure
        self.bug: tuple | None = None  # (workload, failure): the first failure, shrunk
        self.first: tuple | None = None  # (config, workload) of the first failure
        # (config, failing workload) -> the cases its engine ran before it, since it was built
        self.before: Dict[tuple, Tuple[Past, ...]] = {}
        self.seconds_per_case = 1.0

    def _settings(self, max_examples: int) -> settings:
        return settings(database=self.db, max_examples=max_examples, deadline=None, verbosity=Verbosity.quiet,
                        phases=[Phase.reuse, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))

    def _key(self, what: str) -> bytes:
        o = self.opts
        tier = ["long"] if o.long else []  # the short tier's keys as they were
        return json.dumps([what, name_of(o.model), o.device, o.dtype, o.planted] + tier).encode()

    def _now(self) -> float:
        """The budget's clock: seconds of search so far."""
        return time.monotonic() - self.start - self.setup

    def _shrinking_until(self, share: float) -> float:
        return self.failed_at + share * self.shrink_seconds

    def run(self) -> FuzzConfig | None:
        try:
            fault = FAULTS[self.opts.planted] if self.opts.planted else None
            return find(configs(self.opts.device, self.opts.dtype, self.opts.batch_invariant, self.opts.long,
                                fault.attention if fault else None),
                        self._config_fails, settings=self._settings(200),
                        random=Random(self.opts.seed), database_key=self._key("configurations"))
        except NoSuchExample:
            return None

    # ------------------------------------------------------------------------------------------ configurations
    def _config_fails(self, config: FuzzConfig) -> bool:
        if config in self.config_verdicts:
            return self.config_verdicts[config]
        if self.bug is None:
            if self._now() > self.deadline:
                return False
            verdict = self._phase(config)
        else:  # shrinking the configuration: the minimal workload on a simpler one
            if self._now() > self._shrinking_until(1.0):
                return False
            self._prepare(config)
            workload, first = self.bug
            failure = self.evaluator.evaluate(config, workload, only=first)
            verdict = failure is not None and failure.same_bug(first)
            if verdict:
                self.found[config] = (workload, failure)
                self.before[(config, workload)] = tuple(self.evaluator.history[:-1])
        self.config_verdicts[config] = verdict
        return verdict

    def _prepare(self, config: FuzzConfig) -> int:
        t = time.monotonic()
        vocab = self.evaluator.prepare(config)
        self.setup += time.monotonic() - t
        return vocab

    def _phase(self, config: FuzzConfig) -> bool:
        stats = PhaseStats(config)
        self.phases.append(stats)
        vocab = self._prepare(config)
        found = self._search_phase(config, stats, vocab)
        if self.on_phase is not None:
            self.on_phase(len(self.phases), stats)
        return found

    def _search_phase(self, config: FuzzConfig, stats: PhaseStats, vocab: int) -> bool:
        end = min(self.deadline, self._now() + self.phase_seconds)
        verdicts: Dict[Workload, bool] = {}
        failures: Dict[Workload, Failure] = {}
        target: List[Failure] = []

        def fails(workload: Workload) -> bool:
            if workload in verdicts:
                return verdicts[workload]
            now = self._now()
            if now > (end if not target else self._shrinking_until(0.7)):
                return False
            failure = self.evaluator.evaluate(config, workload, only=target[0] if target else None)
            spent = self._now() - now
            stats.cases += 1
            stats.seconds += spent
            if not target:
                self.seconds_per_case = 0.8 * self.seconds_per_case + 0.2 * spent
            if failure is not None and not target:
                target.append(failure)
                stats.failure = failure
                self.first = (config, workload)
                self.failed_at = self._now()
            verdicts[workload] = failure is not None and failure.same_bug(target[0])
            if verdicts[workload]:
                failures[workload] = failure
                self.before[(config, workload)] = tuple(self.evaluator.history[:-1])
            self.tick(f"config {len(self.phases)}, {stats.cases} cases" + (", shrinking" if target else ""))
            return verdicts[workload]

        chunk = 0
        while self._now() < end and not target:
            n = max(2, min(MAX_CHUNK, int((end - self._now()) / self.seconds_per_case) + 1))
            try:
                minimal = find(workloads(vocab, self.opts.long), fails, settings=self._settings(n),
                               random=Random(self.opts.seed * 1_000_003 + len(self.phases) * 1009 + chunk),
                               database_key=self._key(json.dumps(dataclasses.asdict(config))))
            except NoSuchExample:
                chunk += 1
                continue
            self.bug = (minimal, failures[minimal])
            self.found[config] = self.bug
            return True
        return False


def reproduce(evaluator: Evaluator, config: FuzzConfig, workload: Workload,
              before: Tuple[Past, ...], seconds: float) -> Tuple[Tuple[Past, ...], str]:
    """The history a newly built engine needs for the failure to show again (an engine keeps plans, buffers and its
    pool's free list across cases), and how it showed: the case alone; else after the shortest suffix of the cases
    its engine ran before it that brings it back, cut down by delta debugging; at most `seconds` of trials."""

    def fails_after(history: Tuple[Past, ...]) -> bool:
        """Whether the case fails as `--replay` runs it: on a fresh engine, after the history's cases (each with the
        runs it had), every run of it (the runs change the engine's state too, so the failure may show in another
        run than the search's)."""
        evaluator.fresh()
        evaluator.prepare(config)
        for past in history:
            evaluator.evaluate(config, past.workload, only=past.only)  # only the state it leaves matters
        return evaluator.evaluate(config, workload) is not None

    if fails_after(()):
        return (), "alone, on a fresh engine"
    # the state a case needs was most likely left by the cases just before it: the shortest failing suffix of the
    # history (1, 2, 4, ... cases back), then delta debugging within it (dropping runs of cases while it fails)
    end, n, suffix = time.monotonic() + seconds, 1, None
    while suffix is None and time.monotonic() < end:
        if fails_after(before[-n:]):
            suffix = list(before[-n:])
        elif n >= len(before):
            break
        n = min(2 * n, len(before))
    if suffix is None:
        return before, (f"not on a fresh engine, alone or after the {len(before)} cases its engine ran before it: "
                        "the state it needs is not in the cases (it may come from the reference's or a worker's)")
    history, chunk = suffix, max(1, len(suffix) // 2)
    while len(history) > 1 and chunk >= 1 and time.monotonic() < end:
        i, dropped = 0, False
        while i < len(history) and len(history) > 1 and time.monotonic() < end:
            trial = tuple(history[:i] + history[i + chunk:])
            if trial and fails_after(trial):
                history, dropped = list(trial), True
            else:
                i += chunk
        chunk = chunk if dropped and chunk > 1 and len(history) > chunk else chunk // 2
    return tuple(history), (f"on a fresh engine after {len(history)} of the {len(before)} cases its engine ran "
                            "before it (not alone)")


def fuzz(opts: FuzzOptions, evaluator: Evaluator | None = None, tick: Callable[[str], None] = lambda _: None,
         on_phase: Callable[[int, PhaseStats], None] | None = None) -> FuzzResult:
    """Search for the budget; the minimal failing case, if any, is written as JSON under opts.folder/cases.
    evaluator: engines to reuse (built here and closed when None); on_phase(number, stats) as each configuration's
    search ends (its workloads' shrinking included when it found the failure)."""
    own = evaluator is None
    evaluator = evaluator or Evaluator(opts.model, opts.device)
    for dtype in dtypes(opts.device, opts.dtype):  # a missing golden is refused before the search starts
        evaluator.tolerance(dtype)
    search = _Search(opts, evaluator, tick, on_phase)
    counts_before, seconds_before = dict(evaluator.counts), dict(evaluator.seconds)
    try:
        minimal_config = search.run()
        result = FuzzResult(opts, search.phases,
                            {k: v - counts_before.get(k, 0) for k, v in evaluator.counts.items()},
                            {k: v - seconds_before.get(k, 0.0) for k, v in evaluator.seconds.items()},
                            seconds=time.monotonic() - search.start, setup_seconds=search.setup)
        if minimal_config is not None:
            workload, failure = search.found[minimal_config]
            history, how = reproduce(evaluator, minimal_config, workload,
                                     search.before.get((minimal_config, workload), ()), opts.budget / 2)
            result.case = Case(evaluator.model.name, opts.device, minimal_config, workload, failure, opts.planted,
                               opts.seed, history=history, reproduced=how,
                               model_args=evaluator.model.args + evaluator.model.golden_args)
            result.first = search.first
            tag = hashlib.blake2b(result.case.to_json().encode(), digest_size=4).hexdigest()
            name = f"{opts.device.split(':')[0]}-{failure.invariant}-{tag}"
            result.case_path = result.case.write(opts.folder / "cases" / f"{name}.json")
            result.shrink_seconds = search._now() - search.failed_at
    finally:
        if own:
            evaluator.close()
    return result
