"""Tensor parallelism on one host: launch N ranks (one process each) and collect what each returns.

launch(fn, tp_size, *args) runs fn(rank, tp_size, port, *args) in tp_size spawned processes and returns the results
in rank order. A rank that raises or dies ends the run with its traceback; the others get `grace` seconds to finish
(they usually fail fast once a peer's sockets close, or at the engine's distributed_timeout) and are then killed, as
is every rank still running at the deadline: a caller (a test, a parity run) never waits forever.

tp_generate(TPRun(...), tp_size) builds one Engine per rank and runs harness.driver.Driver on each: every rank runs
the same schedule on the same prompts, and the sampled tokens are rank 0's (Engine.forward_batch broadcasts them),
so every rank returns the same tokens. It returns rank 0's output, or every rank's with all_ranks=True.
"""

from __future__ import annotations

import logging
import pickle
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.multiprocessing as mp

from engine.core import SamplingParams
from harness.driver import GenResult

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it); rank 0's rendezvous store binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPLaunchError(RuntimeError):
    """One or more ranks failed, died or did not finish in time; the message holds each one's story."""

    def __init__(self, failures: Dict[int, str]) -> None:
        self.failures = failures
        super().__init__("\n".join(f"--- TP rank {r}: {msg}" for r, msg in sorted(failures.items())))


def _entry(fn: Callable[..., Any], rank: int, size: int, port: int, args: tuple, out: Any) -> None:
    try:
        result = fn(rank, size, port, *args)
        # pickled here with the plain pickler: tensors travel by value, not as shared-memory handles that would
        # die with this process before the launcher reads them
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def launch(fn: Callable[..., Any], tp_size: int, *args: Any, port: int | None = None, timeout: float = 600.0,
           grace: float = 15.0) -> List[Any]:
    """fn(rank, tp_size, port, *args) in tp_size spawned processes; their results in rank order.

    fn and args must be picklable (fn defined at module level). port: the rendezvous port passed to every rank
    (a free one when None). Raises TPLaunchError when a rank raises, dies, or the run passes `timeout` seconds.
    """
    port = free_port() if port is None else port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, rank, tp_size, port, args, out), daemon=True,
                         name=f"tp-rank-{rank}") for rank in range(tp_size)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < tp_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, ok, payload = out.get(timeout=0.2)
            except queue.Empty:
                for rank, p in enumerate(procs):  # died without a word (killed, segfault, os._exit)
                    if rank not in results and rank not in failures and p.exitcode not in (None, 0):
                        failures[rank] = f"process exited with code {p.exitcode} without reporting"
                if failures:
                    deadline = min(deadline, now + grace)
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                deadline = min(deadline, time.monotonic() + grace)  # the others may hang on the dead peer
    finally:
        done = len(results) == tp_size
        for p in procs:
            p.join(timeout=10 if done else 0.5)
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
                if rank not in results and rank not in failures:
                    failures[rank] = (f"still running after {timeout:.0f} s (or {grace:.0f} s after a peer "
                                      "failed): killed")
        out.close()
    if failures:
        raise TPLaunchError(failures)
    return [results[r] for r in range(tp_size)]


# ------------------------------------------------------------------------------------------- generation per rank
@dataclass
class TPRun:
    """One generation on every rank: what the Engine is built with and what the Driver runs."""

    model_path: str
    prompts: List[List[int]]
    params: SamplingParams | List[SamplingParams]
    engine_kwargs: Dict[str, Any] = field(default_factory=dict)  # more EngineConfig fields (dtype, device, ...)
    record_logits: bool = False  # keep every position's raw logits (float32, the full vocabulary) per request
    seed: int | None = None  # reseed torch's RNG with seed + rank after the engine starts (different per rank)
    eos_ids: Sequence[int] = ()
    forced: List[List[int]] | None = None  # Driver.generate's teacher forcing (what parity runs use)
    prefix_lens: List[int] | None = None  # Driver.generate's cached-prefix path
    driver_kwargs: Dict[str, Any] = field(default_factory=dict)  # Driver(...) options, e.g. max_prefill_tokens


@dataclass
class RankOutput:
    rank: int
    tp_size: int
    results: List[GenResult]
    num_pages: int
    max_seq_len: int
    # uid -> [prompt_len - 1 + generated, vocab] in position order: row i predicts the token at position i + 1;
    # log_softmax(row) is what Driver's on_logits hook receives
    logits: Dict[int, torch.Tensor] | None = None
    router_margins: Dict[int, torch.Tensor] | None = None  # uid -> [rows as logits, MoE layers] when recorded


DEFAULT_ENGINE_KWARGS: Dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_running_req": 8,
                                         "num_page_override": 2048, "max_seq_len_override": 512}


def build_engine(rank: int, size: int, port: int, model_path: str, **engine_kwargs: Any) -> Any:
    from engine import Engine, EngineConfig
    from engine.distributed import DistributedInfo

    kw = {**DEFAULT_ENGINE_KWARGS, **engine_kwargs}
    return Engine(EngineConfig(model_path=str(model_path), tp_info=DistributedInfo(rank, size),
                               distributed_port=port, **kw))


def generate_on_rank(rank: int, size: int, port: int, run: TPRun) -> RankOutput:
    """This rank's part of a TP generation: start an Engine, run the Driver to completion, shut the engine down."""
    from harness.driver import Driver

    engine = build_engine(rank, size, port, run.model_path, **run.engine_kwargs)
    try:
        if run.seed is not None:
            torch.manual_seed(run.seed + rank)
        logits: Dict[int, List[torch.Tensor]] = {}
        margins: Dict[int, List[torch.Tensor]] = {}
        if run.record_logits:
            forward_batch = engine.forward_batch

            def recording_forward_batch(batch: Any, args: Any) -> Any:
                spans = [(r.uid, r.extend_len if batch.is_prefill else 1) for r in batch.reqs]
                out = forward_batch(batch, args)
                offset = 0
                for uid, rows in spans:
                    logits.setdefault(uid, []).append(out.logits[offset: offset + rows].clone())
                    if out.router_margins is not None:
                        margins.setdefault(uid, []).append(out.router_margins[offset: offset + rows].cpu())
                    offset += rows
                return out

            engine.forward_batch = recording_forward_batch  # the Driver asks for every position's logits below
        results = Driver(engine, **run.driver_kwargs).generate(
            run.prompts, run.params, eos_ids=run.eos_ids, forced=run.forced, prefix_lens=run.prefix_lens,
            on_logits=(lambda *_: None) if run.record_logits else None)
        return RankOutput(rank, size, results, engine.num_pages, engine.max_seq_len,
                          {uid: torch.cat(parts) for uid, parts in logits.items()} if run.record_logits else None,
                          {uid: torch.cat(parts) for uid, parts in margins.items()} if margins else None)
    finally:
        engine.__dict__.pop("forward_batch", None)  # the recording wrapper: no engine -> closure -> engine cycle
        engine.shutdown()


def generate_many_on_rank(rank: int, size: int, port: int, runs: List[TPRun]) -> List[RankOutput]:
    """Several generations one after another, each with its own engine (a new TP world on the same port)."""
    return [generate_on_rank(rank, size, port, run) for run in runs]


def tp_generate_many(runs: List[TPRun], tp_size: int, timeout: float = 1800.0,
                     port: int | None = None) -> List[RankOutput]:
    """Every run in one launch of tp_size processes (process start-up and imports paid once); rank 0's outputs."""
    return launch(generate_many_on_rank, tp_size, runs, timeout=timeout, port=port)[0]


def tp_generate(run: TPRun, tp_size: int, all_ranks: bool = False, timeout: float = 600.0,
                port: int | None = None) -> RankOutput | List[RankOutput]:
    """Run `run` on tp_size ranks (processes); rank 0's output, or every rank's in rank order."""
    outputs = launch(generate_on_rank, tp_size, run, timeout=timeout, port=port)
    return outputs if all_ranks else outputs[0]
