"""One run of a workload on one engine, through harness.driver.Driver, with what the invariants need recorded: the
tokens, each forward's batch, a digest of every log-probability row, the pool checked after every step, each
request's K/V, and for the reference the top-K log-probabilities and K/V themselves."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np
import torch

from engine import Engine
from engine.core import SamplingParams
from harness.compare import PositionStat, compare_row
from harness.driver import Driver
from harness.fuzz.case import Failure
from harness.fuzz.pool import PoolChecker
from harness.golden import TOP_K

Position = Tuple[int, int]  # (uid, position): the distribution predicted at that position


@dataclass
class Reference:
    """One request alone on the reference engine: its rows are positions 0 .. prompt + tokens - 2."""

    tokens: List[int]
    top_ids: np.ndarray  # [rows, TOP_K] int64
    top_lp: np.ndarray  # [rows, TOP_K] float32
    digests: List[bytes]  # per row
    kv: torch.Tensor  # [2, layers, rows, Hkv, D] in the pool's dtype

    def truncated(self, n_tokens: int) -> "Reference":
        rows = n_tokens - len(self.tokens) + len(self.digests)
        return Reference(self.tokens[:n_tokens], self.top_ids[:rows], self.top_lp[:rows], self.digests[:rows],
                         self.kv[:, :, :rows])


@dataclass
class RunSpec:
    stage: str
    prompts: List[List[int]]
    params: List[SamplingParams]
    eos_ids: List[int]
    overlap: bool
    max_prefill_tokens: int
    prefix_lens: List[int] | None = None
    forced: List[List[int]] | None = None
    prompt_logits: bool = True  # log-probabilities at every prompt position (False: the last one of each prompt)
    check_pool: bool = True  # the pool invariants after every step (they synchronize after every launch)
    capture: bool = False  # keep the top-K log-probabilities and the K/V (a reference run)


@dataclass
class RunOutput:
    tokens: List[List[int]]
    finish: List[str]
    steps: List[tuple]  # each forward's (phase, ((uid, first position, tokens), ...))
    digests: Dict[Position, bytes]
    kv: Dict[int, bytes] = field(default_factory=dict)  # uid -> digest of its K/V at positions it promised
    violation: Failure | None = None  # the first pool invariant that failed
    references: List[Reference] = field(default_factory=list)  # capture only, per uid
    stats: Dict[Position, PositionStat] = field(default_factory=dict)  # against the given references
    pool_steps: int = 0  # steps whose pool was checked


def digest(t: torch.Tensor) -> bytes:
    """Of the bits (numpy has no bfloat16: the bytes are hashed as bytes)."""
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(raw.tobytes(), digest_size=16).digest()


def run_workload(engine: Engine, spec: RunSpec, references: List[Reference] | None = None) -> RunOutput:
    """Run spec on engine; with references (per uid), compare every position's log-probabilities with the
    reference's (parity's measure) and every live request's K/V after every step."""
    digests: Dict[Position, bytes] = {}
    stats: Dict[Position, PositionStat] = {}
    captured: Dict[int, Dict[int, Tuple[np.ndarray, np.ndarray]]] = {}

    def on_logits(uid: int, start: int, lp: torch.Tensor) -> None:
        lp = lp.float().cpu()
        for i in range(lp.shape[0]):
            pos = start + i
            digests[(uid, pos)] = digest(lp[i])
            if spec.capture:
                top = lp[i].topk(TOP_K)
                captured.setdefault(uid, {})[pos] = (top.indices.numpy(), top.values.numpy())
            if references is not None and pos < len(references[uid].digests):
                ref = references[uid]
                stats[(uid, pos)] = compare_row(lp[i], ref.top_ids[pos], ref.top_lp[pos])

    ref_kv = None if references is None else {uid: r.kv for uid, r in enumerate(references)}
    checker = PoolChecker(engine, spec.stage, ref_kv) if spec.check_pool or spec.capture else None
    # chunks of half the budget while other requests decode: every budget the strategies draw also draws that cap
    driver = Driver(engine, max_prefill_tokens=spec.max_prefill_tokens, overlap=spec.overlap,
                    prompt_logits=spec.prompt_logits or spec.capture,
                    decode_chunk_tokens=max(1, (spec.max_prefill_tokens + 1) // 2))
    first = len(driver.steps)
    steps: List[tuple] = []

    def on_step(view) -> None:
        steps.append((view.phase, tuple(view.spans)))
        if checker is not None:
            checker(view)

    try:
        results = driver.generate(spec.prompts, spec.params, eos_ids=spec.eos_ids, forced=spec.forced,
                                  prefix_lens=spec.prefix_lens, on_logits=on_logits, on_step=on_step)
    except Exception:
        if checker is None or checker.violation is None:
            raise
        # what the pool showed first says more than what the driver raised later (a leak check at the end)
        return RunOutput([], [], steps, digests, violation=checker.violation, pool_steps=checker.steps)
    assert len(driver.steps) - first == len(steps)
    out = RunOutput([r.output_ids for r in results], [r.finish_reason for r in results], steps, digests,
                    stats=stats)
    if checker is not None:
        checker.finish()
        out.violation, out.pool_steps = checker.violation, checker.steps
        # K/V at the positions every loop writes: the prompt and every output token but the last (the overlap
        # loop also writes the token after an EOS stop, in the step it wastes)
        kv = {uid: t[:, :, : len(spec.prompts[uid]) + len(out.tokens[uid]) - 1] for uid, t in checker.final.items()}
        out.kv = {uid: digest(t) for uid, t in kv.items()}
        if spec.capture:
            out.references = [_reference(captured[uid], out.tokens[uid], digests, uid, kv[uid])
                              for uid in range(len(spec.prompts))]
    return out


def _reference(rows: Dict[int, Tuple[np.ndarray, np.ndarray]], tokens: List[int], digests: Dict[Position, bytes],
               uid: int, kv: torch.Tensor) -> Reference:
    positions = sorted(rows)
    assert positions == list(range(len(positions))) and kv.shape[2] == len(positions)
    return Reference(tokens, np.stack([rows[p][0] for p in positions]), np.stack([rows[p][1] for p in positions]),
                     [digests[(uid, p)] for p in positions], kv)
