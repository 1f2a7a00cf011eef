"""Every invariant on one case: the runs a case makes, in order, and what each is compared with.

1. reference: each request alone on the reference engine (one slot, page_size 1, no graphs, the simple loop, the same
   dtype and kernels), ignoring EOS; the workload's EOS ids are resolved from these tokens and each reference is cut at
   its first EOS (unless the request ignores EOS).
2. main: the workload free-running with the configuration's loop; the pool invariants after every step. The free
   runs (main, other-loop, repeat, eager-twin) record the log-probabilities of each prompt's last position and of
   every decode position (every prompt position would cost an LM-head row per prompt token).
3. forced: the workload teacher-forced on the references' tokens; the pool invariants, and after every step every
   live request's K/V against its reference's; every position's log-probabilities against the reference's within the
   parity tolerance of the dtype: harness.parity.gate.tolerance of the committed golden of this model, device and
   dtype, on parity's measure (harness.compare.compare_row). Not parity's half-precision distribution gate: its percentiles
   need more positions than one case has.
4. other-loop: the other loop (overlap vs simple): logits bitwise equal wherever the two loops ran the same batches
   (every step up to an EOS stop, after which the overlap loop wastes one), the same token wherever the logits are
   bitwise equal, the same K/V when every batch was the same.
5. repeat: main again, without the pool checks (they synchronize): bitwise equal in everything.
6. eager-twin (CUDA graphs on): main on the same engine without graphs, in a process of its own: bitwise equal in
   everything. process-twin (graphs off): main on an engine of the same configuration in a process of its own, started
   anew for each configuration: bitwise equal in everything (the same inputs and configuration give the same bits in
   every process).
7. seeded-alone: a request whose tokens do not depend on its uid (greedy or seeded) samples the reference's token
   wherever its logits are bitwise equal to the reference's, alone.
8. alone (batch-invariant configurations): each request alone on the reference engine (one slot, page_size 1, the
   other loop), with the case's prefill budget and prefix split: its log-probabilities bitwise equal to main's at
   every position both computed up to where their sampled tokens part (a request without a seed of its own draws
   by its uid), and its tokens equal there.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Dict, List, Set

from engine import Engine
from harness import golden as G
from harness.fuzz.case import Failure, FuzzConfig, Past, RequestSpec, Workload
from harness.fuzz.faults import active
from harness.fuzz.engines import EngineHost, EngineWorker, WorkerError
from harness.fuzz.runs import Position, Reference, RunOutput, RunSpec, run_workload
from harness.golden import TOP_K
from harness.models import ModelRef, as_model
from harness.parity.gate import tolerance

STAGES = ("main", "forced", "other-loop", "repeat", "eager-twin", "process-twin", "alone")
# need the main run besides their own
COMPARISONS = ("overlap-simple", "repeat", "graphs-eager", "process", "seeded-alone", "batch-invariant")


class Evaluator:
    """The engines of a fuzz run (this process's engine under test, the reference and twin workers) and the
    references computed so far. Counts what it checked in `counts`."""

    def __init__(self, model: ModelRef | str, device: str) -> None:
        model = as_model(model)
        self.model, self.device = model, device
        self.host = EngineHost(model)
        self.reference = EngineWorker("reference", model)
        self.twin = EngineWorker("twin", model)  # the eager twin of a graph engine, else the same one
        self.references: Dict[tuple, Reference] = {}
        self.tolerances: Dict[str, tuple] = {}
        self.counts: Counter = Counter()
        self.seconds: Counter = Counter()  # by run: reference, main, forced, ...
        # the engine under test keeps state across cases (plans, buffers, its pool's free list): the cases run on it
        # since it was built, the last one included
        self.history: List[Past] = []
        self._build = 0

    def close(self) -> None:
        self.host.close()
        for worker in (self.reference, self.twin):
            worker.close()

    def fresh(self) -> None:
        """The next case runs on a newly built engine under test, with no history."""
        self.host.close()
        self.history = []

    def prepare(self, config: FuzzConfig) -> int:
        """Build (or keep) every engine the configuration needs, and load its tolerance; the vocabulary size."""
        self.tolerance(config.dtype)
        self.reference.configure(config.reference_kwargs(self.device))
        self.twin.configure(config.eager_kwargs(self.device), fresh_process=True, plant=active())
        return self.host.get(config.engine_kwargs(self.device)).config.model_config.vocab_size

    def tolerance(self, dtype: str) -> tuple:
        """(tol, where it came from): parity's tolerance from the committed golden."""
        if dtype not in self.tolerances:
            device_type = self.device.split(":")[0]
            gs = G.load_checked(self.model, device_type, dtype)
            where = G.golden_dir(self.model, device_type, dtype)
            self.tolerances[dtype] = (tolerance(gs, dtype), str(where.relative_to(G.GOLDEN_DIR.parent)
                                                                if where.is_relative_to(G.GOLDEN_DIR) else where))
        return self.tolerances[dtype]

    # ------------------------------------------------------------------------------------------ one case
    def evaluate(self, config: FuzzConfig, workload: Workload, only: Failure | None = None) -> Failure | None:
        """The first invariant the case breaks, or None. only: run just what that failure needs (while shrinking)."""
        stages = set(STAGES) if only is None else {only.stage} | ({"main"} if only.invariant in COMPARISONS else set())
        self.tolerance(config.dtype)  # a missing golden is the user's to fix, not a finding: raise it here
        engine = self.host.get(config.engine_kwargs(self.device))  # an engine that cannot start is an error here
        if self._build != self.host.builds:
            self._build, self.history = self.host.builds, []
        self.history.append(Past(workload, only))
        self.counts["cases"] += 1
        stage = "reference"
        try:
            t0 = time.perf_counter()
            refs = [self._reference(config, r) for r in workload.requests]
            self.seconds["reference"] += time.perf_counter() - t0
            eos = sorted({refs[k].tokens[j] for k, j in workload.eos if j < len(refs[k].tokens)})
            cut = [ref if r.ignore_eos else ref.truncated(_first_eos(ref.tokens, eos)) for r, ref in zip(
                workload.requests, refs)]
            free = RunSpec("main", [list(r.prompt) for r in workload.requests], [r.params() for r in workload.requests],
                           eos, config.overlap, config.max_prefill_tokens,
                           prefix_lens=[r.prefix_len for r in workload.requests], prompt_logits=False)
            main = None
            for stage in [s for s in STAGES if s in stages]:
                t0 = time.perf_counter()
                failure, out = self._stage(stage, config, workload, engine, free, cut, main)
                self.seconds[stage] += time.perf_counter() - t0
                if failure is not None:
                    return failure
                main = out if stage == "main" else main
            return None
        except WorkerError:
            raise
        except Exception as e:  # the engine or the driver raised: that is a finding too
            return Failure("runs", stage, f"{type(e).__name__}: {e}")

    def _stage(self, stage: str, config: FuzzConfig, workload: Workload, engine: Engine, free: RunSpec,
               refs: List[Reference], main: RunOutput | None) -> tuple:
        if stage == "main":
            out = self._run(engine, free)
            return out.violation or seeded_alone(out, refs, workload.requests, self.counts), out
        if stage == "forced":
            spec = dataclasses.replace(free, stage="forced", forced=[r.tokens for r in refs], prompt_logits=True)
            out = self._run(engine, spec, refs)
            return out.violation or self._logits(config, out, refs), out
        if stage == "other-loop":
            out = self._run(engine, dataclasses.replace(free, stage="other-loop", overlap=not free.overlap))
            return out.violation or compare_loops(main, out, free.prompts, self.counts), out
        if stage == "repeat":
            out = self._run(engine, dataclasses.replace(free, stage="repeat", check_pool=False))
            return compare_bitwise(main, out, "repeat", "repeat", self.counts), out
        if stage == "alone":
            return (self._alone(config, workload, free, main) if config.batch_invariant else None), None
        if (stage == "eager-twin") != config.graphs:  # one twin a case: eager beside graphs, else the same engine
            return None, None
        self.twin.configure(config.eager_kwargs(self.device), fresh_process=True, plant=active())
        out = self.twin.run(dataclasses.replace(free, stage=stage))
        self.counts["runs"] += 1
        invariant = "graphs-eager" if config.graphs else "process"
        return out.violation or compare_bitwise(main, out, invariant, stage, self.counts), out

    def _alone(self, config: FuzzConfig, workload: Workload, free: RunSpec, main: RunOutput) -> Failure | None:
        """Each request alone, on the reference engine with the case's budget and prefix split and the other loop,
        against main: bitwise (batch_invariant)."""
        self.reference.configure(config.reference_kwargs(self.device))
        for uid, r in enumerate(workload.requests):
            out = self.reference.run(dataclasses.replace(
                free, stage="alone", prompts=[list(r.prompt)], params=[r.params()], overlap=not free.overlap,
                prefix_lens=[r.prefix_len], check_pool=False))
            self.counts["runs"] += 1
            failure = out.violation or batch_invariant(main, out, uid, len(r.prompt), r.uid_free, self.counts)
            if failure is not None:
                return failure
        return None

    def _run(self, engine: Engine, spec: RunSpec, refs: List[Reference] | None = None) -> RunOutput:
        out = run_workload(engine, spec, refs)
        self.counts["runs"] += 1
        self.counts["pool steps"] += out.pool_steps
        return out

    def _reference(self, config: FuzzConfig, r: RequestSpec) -> Reference:
        kwargs = config.reference_kwargs(self.device)
        key = (tuple(sorted(kwargs.items(), key=str)), dataclasses.replace(r, ignore_eos=True, prefix_len=0))
        if key not in self.references:
            self.reference.configure(kwargs)
            out = self.reference.run(RunSpec("reference", [list(r.prompt)], [r.params(ignore_eos=True)], [],
                                             overlap=False, max_prefill_tokens=config.max_seq_len, capture=True))
            if out.violation is not None:
                raise WorkerError(f"the reference engine broke a pool invariant: {out.violation}")
            self.references[key] = out.references[0]
            self.counts["reference runs"] += 1
        return self.references[key]

    def _logits(self, config: FuzzConfig, out: RunOutput, refs: List[Reference]) -> Failure | None:
        tol, source = self.tolerance(config.dtype)
        want = sum(len(r.digests) for r in refs)
        if len(out.stats) != want:
            return Failure("logits-reference", "forced", f"only {len(out.stats)} of {want} positions produced")
        self.counts["positions vs reference"] += want
        for (uid, pos), st in sorted(out.stats.items()):
            if st.err > tol:
                return Failure("logits-reference", "forced", (
                    f"request {uid} position {pos}: max |log-probability - reference's| on the reference's top-{TOP_K} "
                    f"ids {st.err:.3g} > {tol:.3g} (the parity tolerance of {source})"))
        return None


def _first_eos(tokens: List[int], eos: List[int]) -> int:
    """How many tokens a request stopping at EOS keeps: through its first EOS id."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


# ---------------------------------------------------------------------------------------------- comparisons
def _positions(steps: List[tuple]) -> Set[Position]:
    return {(uid, start + i) for _, spans in steps for uid, start, n in spans for i in range(n)}


def compare_bitwise(a: RunOutput, b: RunOutput, invariant: str, stage: str, counts: Counter) -> Failure | None:
    """b must be a's run again: the same batches, bitwise the same log-probabilities, tokens and K/V."""
    def fail(details: str) -> Failure:
        return Failure(invariant, stage, details)

    for i, (x, y) in enumerate(zip(a.steps, b.steps)):
        if x != y:
            return fail(f"step {i}: main ran {x}, {stage} ran {y}")
    if len(a.steps) != len(b.steps):
        return fail(f"main ran {len(a.steps)} steps, {stage} {len(b.steps)}")
    differ = sorted((p for p in a.digests.keys() | b.digests.keys() if a.digests.get(p) != b.digests.get(p)),
                    key=lambda p: (p[1], p[0]))
    counts["positions compared bitwise"] += len(a.digests)
    if differ:
        uid, pos = differ[0]
        return fail(f"request {uid} position {pos}: the log-probabilities are not bitwise equal "
                    f"({len(differ)} positions differ)")
    for uid, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y or a.finish[uid] != b.finish[uid]:
            return fail(f"request {uid}: tokens {x} ({a.finish[uid]}) in main, {y} ({b.finish[uid]}) in {stage}")
    if a.kv and b.kv and a.kv != b.kv:
        uid = next(u for u in a.kv if a.kv[u] != b.kv.get(u))
        return fail(f"request {uid}: its K/V in the pool are not bitwise equal")
    return None


def compare_loops(a: RunOutput, b: RunOutput, prompts: List[List[int]], counts: Counter) -> Failure | None:
    """The loops build the same batches until a request stops at EOS (the overlap loop then wastes a step, and every
    later batch may differ): bitwise equal logits there, and the same token wherever the logits are bitwise equal."""
    common = next((i for i, (x, y) in enumerate(zip(a.steps, b.steps)) if x != y), min(len(a.steps), len(b.steps)))
    same_batches = common == len(a.steps) == len(b.steps)
    if not same_batches and "eos" not in a.finish + b.finish:
        return Failure("overlap-simple", "other-loop", f"the loops ran different batches without an EOS stop, from "
                       f"step {common}: {a.steps[common:common + 1]} against {b.steps[common:common + 1]}")
    shared = sorted(_positions(a.steps[:common]) & a.digests.keys(), key=lambda p: (p[1], p[0]))
    counts["positions compared bitwise"] += len(shared)
    for uid, pos in shared:
        if a.digests[(uid, pos)] != b.digests.get((uid, pos)):
            return Failure("overlap-simple", "other-loop", f"request {uid} position {pos}: the log-probabilities "
                           f"differ although both loops computed it in the same batch (step < {common})")
    for uid, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        for j, (s, t) in enumerate(zip(x, y)):
            pos = len(prompts[uid]) - 1 + j
            if s != t:
                if a.digests.get((uid, pos)) == b.digests.get((uid, pos)):
                    return Failure("overlap-simple", "other-loop", f"request {uid} token {j}: {s} in one loop, {t} "
                                   "in the other, from bitwise equal log-probabilities")
                break
        else:
            if (len(x), a.finish[uid]) != (len(y), b.finish[uid]):
                return Failure("overlap-simple", "other-loop", f"request {uid}: {len(x)} tokens ({a.finish[uid]}) "
                               f"in one loop, {len(y)} ({b.finish[uid]}) in the other, the same up to there")
    if same_batches and a.kv != b.kv:
        uid = next(u for u in a.kv if a.kv[u] != b.kv.get(u))
        return Failure("overlap-simple", "other-loop", f"request {uid}: K/V not bitwise equal after the same batches")
    return None


def seeded_alone(main: RunOutput, refs: List[Reference], requests: tuple, counts: Counter) -> Failure | None:
    """A greedy or seeded request's token at a position depends on its logits there and its seed only: where its
    logits in the batch are bitwise its logits alone, the token must be the same."""
    for uid, (r, ref) in enumerate(zip(requests, refs)):
        if not r.uid_free:
            continue
        for j, (s, t) in enumerate(zip(main.tokens[uid], ref.tokens)):
            pos = len(r.prompt) - 1 + j
            equal = main.digests.get((uid, pos)) == ref.digests[pos]
            counts["seeded positions with bitwise logits"] += equal
            if equal and s != t:
                return Failure("seeded-alone", "main", f"request {uid} token {j}: {s} in the batch, {t} alone, from "
                               "bitwise equal log-probabilities")
            if s != t:
                break
    return None


def batch_invariant(main: RunOutput, alone: RunOutput, uid: int, prompt_len: int, uid_free: bool,
                    counts: Counter) -> Failure | None:
    """Request uid of main against its run alone (uid 0 there): bitwise equal log-probabilities at every position
    both computed, up to the first token that differs (from there their inputs differ), and no differing token at
    all when its draws do not depend on its uid."""
    ours, theirs = main.tokens[uid], alone.tokens[0]
    parted = next((j for j, (s, t) in enumerate(zip(ours, theirs)) if s != t), min(len(ours), len(theirs)))
    last = prompt_len - 1 + parted  # the last position whose inputs are the same in both runs
    positions = sorted(pos for u, pos in main.digests if u == uid and pos <= last and (0, pos) in alone.digests)
    if not positions:
        return Failure("batch-invariant", "alone", f"request {uid}: no position computed both in the batch and "
                       "alone")
    counts["positions compared alone, bitwise"] += len(positions)
    for pos in positions:
        if main.digests[(uid, pos)] != alone.digests[(0, pos)]:
            return Failure("batch-invariant", "alone", f"request {uid} position {pos}: the log-probabilities in the "
                           "batch are not bitwise those of the request alone")
    if uid_free and parted < min(len(ours), len(theirs)):
        return Failure("batch-invariant", "alone", f"request {uid} token {parted}: {ours[parted]} in the batch, "
                       f"{theirs[parted]} alone, from bitwise equal log-probabilities")
    return None
