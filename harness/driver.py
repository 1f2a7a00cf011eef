"""The driver: what the spec's hand-driven loop does, automated, with continuous batching and overlap scheduling.

It owns request slots (page-table rows), KV pages and a token pool on the device, builds each batch, finishes
requests at max_tokens or an EOS id, and returns their pages. Prefill batches run first whenever a waiting request
fits; otherwise every running request decodes one token.

Chunked prefill: a prompt longer than the prefill budget (max_prefill_tokens, at most the engine's max_forward_len)
is prefilled in chunks, each an extend over the prompt's own cached prefix, so any prompt up to max_seq_len is
served and no forward carries more tokens than the memory plan reserved activations for. Its slot and the pages of
the whole request are held from its first chunk (admission waits for them, and logs that it does); nothing is sampled
until its last chunk (a chunk's draw is discarded: the request is not among the step's members). Its remaining
chunks lead the next prefill steps; whole prompts that fit the rest of a step's budget join them. With nothing
decoding, prompts within the budget are never cut, so every batch of them is what it was without chunking.

Running requests keep decoding (mixed steps, the default): a step decodes every running request first, then carries
prompt work (chunks of prompts under way, then new prompts) within the step budget (harness.step_budget): by
default the cost of decode_chunk_tokens prompt tokens at depth 0 in the model's FLOP counts, so that a deep chunk
carries fewer tokens than a shallow one; or a time budget over a measured cost model (stall: a step at most that many
times its decodes alone). A decode row is a one-token extend in the prefill batch, its input id gathered on the device
from the token pool as a decode step's is. With nothing to prefill, a step decodes alone (its CUDA graph, its decode
kernels).
In batch-invariant mode (EngineConfig.batch_invariant), or with mixed=False, steps alternate instead: after a step
that carried a chunk (not the last), the next decodes every running request, and a running request's tokens never
go through a prefill batch. Batch-invariant mode also fixes a prompt's chunks whatever else runs: every chunk of a
prompt over the budget is the smaller of the budget and decode_chunk_tokens, and a prompt under way whose next chunk
does not fit what the step has left waits for the next step rather than take a shorter one (a prompt's bits follow
its chunks: their attention sums over other lengths).

Online: serve(source) admits requests as a Source hands them over (requests arriving over time: a replayed trace, a
server's queue), waits for the next when idle, and reports each token as the host reads it (on_token), so that a
request's time to first token and inter-token latencies are what a client of this loop sees. generate() is serve()
over every request at once.

Two loops share every step function and differ only in order (mini-sglang's normal_loop / overlap_loop):
- simple: schedule step N, launch it, wait for its tokens, process them;
- overlap (the default): schedule and launch step N + 1 before processing step N, so the host's work (batch build,
  attention planning, sampler preparation) runs while the GPU computes. The sampled tokens never visit the host on
  their way to the next step: forward_batch's next_tokens_gpu is scattered into the token pool, and the next decode
  gathers its input ids (and KV slots) from the pool and the page table on the device. The host reads step N's
  tokens one step late; a request that hit EOS at step N has already been scheduled into step N + 1, whose token is
  dropped (one wasted slot-step, never a wrong token). Requests that stop at max_tokens are known at schedule time,
  so both loops build the same batches until a request stops at EOS.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, List, Literal, Protocol, Sequence, Tuple

import numpy as np
import torch

from engine import Engine, ForwardOutput
from engine.core import Batch, Req, SamplingParams
from engine.sample import INVALID_TOKEN
from engine.utils.device import make_device_tensor, pin, pinned
from harness.step_budget import StepBudget, StepCost, pairs

logger = logging.getLogger(__name__)

# (uid, first position of these rows, logprobs [rows, vocab] float32) -> None
LogitsHook = Callable[[int, int, torch.Tensor], None]
# (uid, first position, router margins [rows, MoE layers] float32) -> None; needs EngineConfig.record_router_margins
RouterHook = Callable[[int, int, torch.Tensor], None]
# (uid, token, perf_counter when the host read it): every token a request keeps, in order; a step's share one time
TokenHook = Callable[[int, int, float], None]
Phase = Literal["prefill", "decode"]
UNSAMPLED = SamplingParams()  # a chunk that is not its prompt's last: greedy, the cheapest draw, which is discarded


@dataclass
class LiveRequest:
    """A request that holds a slot and pages, as a step hook sees it."""

    uid: int
    row: int  # its page-table row
    pages: List[int]
    written: int  # positions [0, written) have K/V in its pages once the launched forwards complete


@dataclass
class StepView:
    """A forward just launched (its writes land once the device catches up) and every request holding pages."""

    phase: Phase
    batch: Batch
    spans: List[Tuple[int, int, int]]  # (uid, first position, tokens) the forward feeds, and writes K/V for
    live: List[LiveRequest]
    free_pages: List[int]


StepHook = Callable[[StepView], None]


@dataclass
class Arrival:
    """A request as a Source hands it to serve(): its uid (unique in the run) names it in results and hooks."""

    uid: int
    prompt: List[int]
    params: SamplingParams


class Source(Protocol):
    def take(self, finished: int, wait: bool) -> List[Arrival] | None:
        """The requests that have arrived since the last call, in order, given how many of those handed over have
        finished; wait: the loop is idle, so block until one arrives. None: none will arrive any more."""


@dataclass
class StepRecord:
    """One forward as the driver saw it. Host seconds by part; `seconds` is the step's period: from its launch to
    the next step's launch (or to the end of the run), which with overlap is the rate steps complete at."""

    phase: Phase
    batch_size: int
    num_tokens: int  # tokens fed to the model
    kv_tokens: int  # tokens of KV attended over (sum of device_len)
    start: float = 0.0  # perf_counter at the start of its scheduling
    seconds: float = 0.0
    host: Dict[str, float] = field(default_factory=dict)  # build, plan, sample_prep, launch, wait, process
    pairs: int = 0  # attention (query, key) pairs of its extends (harness.step_budget.pairs)
    decode_rows: int = 0  # running requests it decodes (a decode step's every row; a mixed step's first rows)
    deepest: int = 0  # a prefill step's keys of its deepest request (harness.step_budget.StepCost.per_key)


@dataclass
class GenResult:
    uid: int
    prompt_ids: List[int]
    output_ids: List[int] = field(default_factory=list)  # what the engine sampled at each step
    finish_reason: Literal["length", "eos", ""] = ""


@dataclass(eq=False)
class _Running:
    req: Req
    result: GenResult
    pages: np.ndarray  # int64
    forced: List[int] | None
    max_tokens: int
    prefix_len: int = 0  # > 0: the prompt's first prefix_len tokens are prefilled on their own first
    launched: int = 0  # forwards launched that sample one of its tokens

    @property
    def prefilling(self) -> bool:
        """Its prompt's last chunk is not launched yet (req.cached_len: the prompt positions launched so far)."""
        return self.req.device_len == len(self.result.prompt_ids)


@dataclass
class _Step:
    """A launched forward and what processing it needs."""

    phase: Phase
    members: List[_Running]  # the requests whose sampled token this step produces
    spans: List[Tuple[int, int, int]]  # (uid, first position, rows) of the logits handed to on_logits
    record: StepRecord
    batch: Batch
    decode_rows: int = 0  # its first rows decode running requests (their input ids are gathered on the device)
    feed: torch.Tensor | None = None  # int64 flat token-pool indices of the members' sampled tokens (decode)
    out: ForwardOutput | None = None


class PageAllocator:
    """The KV pool's pages: a FIFO free list (a ring of page ids) and a held flag per page, in numpy, so that a
    request's pages cost array operations, not a Python step per page (an H200's pool at page size 1 is about a
    million pages; a 4096-token request's 4097 pages took 0.5 ms to allocate and free one by one)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._ring = np.arange(num_pages, dtype=np.int64)  # free pages from _head, num_free of them (wrapping)
        self._head = 0
        self.num_free = num_pages
        self.held = np.zeros(num_pages, dtype=bool)
        self.num_held = 0
        self.double_frees = 0  # pages given back while not held (they are still added: the pool checks see it)

    @property
    def free_pages(self) -> List[int]:
        """The free list in the order it hands pages out (a copy, O(pool): for checks, not for the step)."""
        return self._ring[self._at(self._head, self.num_free)].tolist()

    def _at(self, start: int, n: int) -> slice | np.ndarray:
        """The ring's n places from start, for reading or writing: a slice unless they wrap around its end."""
        if start + n <= len(self._ring):
            return slice(start, start + n)
        return (start + np.arange(n)) % len(self._ring)

    def alloc(self, n: int) -> np.ndarray:
        assert n <= self.num_free
        pages = self._ring[self._at(self._head, n)].copy()
        self._head = (self._head + n) % len(self._ring)
        self.num_free -= n
        self.held[pages] = True
        self.num_held += n
        return pages

    def free(self, pages: Sequence[int]) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        if not len(pages):
            return
        distinct = np.sort(pages)  # (np.unique took 20x a sort on 4097 pages)
        distinct = distinct[np.concatenate(([True], distinct[1:] != distinct[:-1]))]
        valid = distinct[self.held[distinct]]
        self.held[valid] = False
        self.num_held -= len(valid)
        self.double_frees += len(pages) - len(valid)
        if self.num_free + len(pages) > len(self._ring):  # only pages freed twice overflow the pool's size
            self._ring = np.concatenate([self._ring[self._at(self._head, self.num_free)],
                                         np.empty(len(pages) + len(self._ring), dtype=np.int64)])
            self._head = 0
        self._ring[self._at((self._head + self.num_free) % len(self._ring), len(pages))] = pages
        self.num_free += len(pages)

    def check_no_leak(self) -> None:
        if self.num_held or self.double_frees or self.num_free != self.num_pages:
            raise AssertionError(f"KV pages leaked or freed twice: {self.num_held} of {self.num_pages} still held, "
                                 f"{self.double_frees} freed while free, {self.num_free} on the free list")


def eos_token_ids(model_path: str | Path) -> List[int]:
    """Every EOS id of the model's generation config (it may list several)."""
    cfg = Path(model_path) / "generation_config.json"
    if not cfg.is_file():
        return []
    eos = json.loads(cfg.read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@dataclass
class _Hooks:
    """What one run of the loop calls, and the EOS ids it stops at."""

    eos: frozenset
    on_finish: Callable[[GenResult], None]
    on_logits: LogitsHook | None = None
    on_step: StepHook | None = None
    on_router: RouterHook | None = None
    on_token: TokenHook | None = None


class _Entries(Protocol):
    def take(self, finished: int, wait: bool) -> Sequence[tuple] | None:
        """A Source's take, each request as a waiting entry: (uid, prompt, params, forced, prefix_len)."""


class _Everything:
    """generate()'s source: every request at once."""

    def __init__(self, entries: Deque[tuple]) -> None:
        self.entries: Deque[tuple] | None = entries

    def take(self, finished: int, wait: bool) -> Deque[tuple] | None:
        entries, self.entries = self.entries, None
        return entries


class Driver:
    def __init__(self, engine: Engine, max_prefill_tokens: int = 4096, overlap: bool = True,
                 prompt_logits: bool = True, decode_chunk_tokens: int = 1024, step_budget: StepBudget | None = None,
                 mixed: bool | None = None) -> None:
        """max_prefill_tokens: the most tokens one prefill step carries (at most the engine's max_forward_len);
        longer prompts are prefilled in chunks. decode_chunk_tokens: while other requests decode, the prompt work of a
        step costs at most as much as this many prompt tokens at depth 0 (the default step budget, in the model's
        FLOPs; alternating steps: a chunk's tokens). step_budget: another budget for mixed steps (a stall over a
        measured cost). mixed: decode running requests in the steps that carry prompt work (default: unless the
        engine is batch-invariant). prompt_logits: on_logits gets every prompt position (False: each prompt's last
        only, one LM-head row)."""
        if max_prefill_tokens < 1 or decode_chunk_tokens < 1:
            raise ValueError(f"max_prefill_tokens ({max_prefill_tokens}) and decode_chunk_tokens "
                             f"({decode_chunk_tokens}) must be >= 1")
        self.engine = engine
        self.prompt_logits = prompt_logits
        self.max_prefill_tokens = min(max_prefill_tokens, engine.config.max_forward_len)
        self.decode_chunk_tokens = decode_chunk_tokens
        self.mixed = not engine.config.batch_invariant if mixed is None else mixed
        if self.mixed and engine.config.batch_invariant:
            raise ValueError("mixed steps put running requests through prefill batches; batch-invariant mode forbids "
                             "it (leave mixed unset)")
        self.budget = step_budget or StepBudget(StepCost.from_config(engine.config.model_config),
                                                tokens=decode_chunk_tokens)
        self._after_chunk = False  # the last step carried a chunk that was not its prompt's last: decodes go next
        self._waiting_logged: int | None = None  # the uid whose wait for pages was logged last
        self.overlap = overlap
        self.page_size = engine.config.page_size
        self.pages = PageAllocator(engine.num_pages)
        self.free_rows: Deque[int] = deque(range(engine.config.max_running_req))
        self.row_pages: Dict[int, np.ndarray] = {}  # each occupied row's pages (host), for prefill slots
        # each row's tokens by position, on the device: a decode step's input ids come from here
        self.token_pool = torch.zeros_like(engine.page_table)
        self.steps: List[StepRecord] = []  # every forward, for benchmarks

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 eos_ids: Sequence[int] = (), forced: Sequence[Sequence[int]] | None = None,
                 prefix_lens: Sequence[int] | None = None, on_logits: LogitsHook | None = None,
                 on_step: StepHook | None = None, on_router: RouterHook | None = None) -> List[GenResult]:
        """Run every prompt to completion; results in prompt order.

        forced: feed these tokens instead of the sampled ones (teacher forcing); each request then makes
        len(forced[i]) steps. prefix_lens: prefill that many prompt tokens first, then the rest as an extend over
        the cached prefix. on_logits: receives log-probabilities at every prefill and decode position; on_router the
        same positions' router margins, when the engine records them. on_step: called after every launch, to check
        the pool and the pages between steps.
        """
        n = len(prompts)
        plist = list(params) if isinstance(params, Sequence) else [params] * n
        if len(plist) != n or (forced is not None and len(forced) != n):
            raise ValueError("prompts, params and forced must have the same length")
        waiting: Deque[tuple] = deque(
            (uid, list(map(int, prompts[uid])), plist[uid], None if forced is None else list(forced[uid]),
             0 if prefix_lens is None else prefix_lens[uid]) for uid in range(n))
        for uid, prompt, p, f, _ in waiting:
            self.check_fits(uid, len(prompt), len(f) if f is not None else p.max_tokens)
        results: Dict[int, GenResult] = {}
        self._loop(_Everything(waiting), _Hooks(frozenset(eos_ids), lambda r: results.__setitem__(r.uid, r),
                                                on_logits, on_step, on_router))
        return [results[uid] for uid in range(n)]

    @torch.inference_mode()
    def serve(self, source: Source, eos_ids: Sequence[int] = (), on_token: TokenHook | None = None,
              on_finish: Callable[[GenResult], None] | None = None, on_step: StepHook | None = None) -> None:
        """Serve the requests source hands over as they arrive, until it has none left and all have finished:
        on_token as the host reads each token, on_finish with each request's result. A request that cannot fit the
        engine raises ValueError when it arrives (check_fits tells beforehand)."""
        def arrived(a: Arrival) -> tuple:
            self.check_fits(a.uid, len(a.prompt), a.params.max_tokens)
            return a.uid, list(map(int, a.prompt)), a.params, None, 0

        class Checked:
            def take(self, finished: int, wait: bool) -> List[tuple] | None:
                got = source.take(finished, wait)
                return None if got is None else [arrived(a) for a in got]

        self._loop(Checked(), _Hooks(frozenset(eos_ids), on_finish or (lambda r: None), on_step=on_step,
                                     on_token=on_token))

    def _loop(self, source: _Entries, hooks: _Hooks) -> None:
        """The loop both entry points share: take what arrived (waiting for it when idle), schedule, launch,
        process (one step late with overlap)."""
        waiting: Deque[tuple] = deque()
        running: List[_Running] = []
        finished = [0]
        finish = hooks.on_finish

        def count(r: GenResult) -> None:
            finished[0] += 1
            finish(r)

        hooks.on_finish = count
        first = len(self.steps)
        pending: List[_Step] = []  # launched, not processed (overlap only)
        open_ = True
        while True:
            idle = not (waiting or running or pending)
            if open_:
                got = source.take(finished[0], wait=idle)
                open_ = got is not None
                waiting.extend(got or ())
            if not (waiting or running or pending):
                if open_:
                    continue
                break
            steps = self._schedule(waiting, running, hooks.on_logits)
            for step in steps:
                self._launch(step)
                if hooks.on_step is not None:
                    live = [LiveRequest(r.req.uid, r.req.table_idx, r.pages.tolist(), r.req.cached_len)
                            for r in running]
                    hooks.on_step(StepView(step.phase, step.batch, step.spans, live, self.pages.free_pages))
            if self.overlap:
                for step in pending:
                    self._process(step, hooks)
                pending = steps
            else:
                for step in steps:
                    self._process(step, hooks)
        self._close_records(first)
        self.pages.check_no_leak()

    # ---------------------------------------------------------------------------------------- admission
    def check_fits(self, uid: int, prompt_len: int, max_tokens: int) -> None:
        """A ValueError saying why a request can never be served here (an empty or too long prompt, a small pool)."""
        if prompt_len == 0:
            raise ValueError(f"request {uid}: the prompt is empty (at least one token is needed)")
        need = prompt_len + max_tokens
        limit = (f"max_seq_len {self.engine.max_seq_len} (the smaller of the model's or override's "
                 f"{self.engine.config.max_seq_len} and the KV pool's {self.pages.num_pages * self.page_size} tokens)")
        if prompt_len > self.engine.max_seq_len:
            raise ValueError(f"request {uid}: prompt of {prompt_len} tokens exceeds {limit}")
        if need > self.engine.max_seq_len:
            raise ValueError(f"request {uid}: prompt {prompt_len} + max_tokens {max_tokens} exceeds {limit}; "
                             "lower max_tokens or raise max_seq_len_override / the KV pool")
        if -(-need // self.page_size) > self.pages.num_pages:
            raise ValueError(f"request {uid}: needs {need} KV slots but the pool holds only "
                             f"{self.pages.num_pages * self.page_size}; raise num_page_override or memory_ratio")

    def _admit(self, waiting: Deque, tokens: int, allowance: float, first: bool) -> _Running | None:
        """The next waiting request, with a slot and its pages for the whole request (prompt and max_tokens), if
        they are free and its prompt fits the step's remaining tokens and allowance (a step's first may be longer:
        it is cut into chunks); None when it must wait."""
        if not waiting or not self.free_rows:
            return None
        uid, prompt, p, f, prefix_len = waiting[0]
        max_tokens = len(f) if f is not None else p.max_tokens
        npages = -(-(len(prompt) + max_tokens) // self.page_size)
        if not first and (len(prompt) > tokens or self.budget.cost.variable(len(prompt), 0) > allowance):
            return None
        if npages > self.pages.num_free:
            if self._waiting_logged != uid:  # once a request: the loop asks again every step
                logger.info("request %d waits for %d KV pages (%d free) before its prefill starts", uid, npages,
                            self.pages.num_free)
                self._waiting_logged = uid
            return None
        waiting.popleft()
        row, pages = self.free_rows.popleft(), self.pages.alloc(npages)
        self.row_pages[row] = pages
        slots = self._slots(row, np.arange(npages * self.page_size))
        self.engine.page_table[row, : len(slots)].copy_(pinned(slots, torch.int32, self.engine.device),
                                                        non_blocking=True)
        req = Req(input_ids=self._prompt_ids(uid, prompt), table_idx=row, cached_len=0,
                  output_len=max_tokens, uid=uid, sampling_params=p, cache_handle=None)
        return _Running(req, GenResult(uid, prompt), pages, f, max_tokens, prefix_len)

    def _prompt_ids(self, uid: int, prompt: List[int]) -> torch.Tensor:
        """The prompt as an int32 host tensor, through numpy (torch.tensor of a 4096-id list took 180 us on a 2-core
        CPU host, np.asarray 48 us). An id int32 cannot hold is outside any vocabulary: said so, as the engine says
        it of the others."""
        try:
            return torch.from_numpy(np.asarray(prompt, dtype=np.int32))
        except OverflowError:
            bad = [t for t in prompt if not -2 ** 31 <= t < 2 ** 31][:5]
            raise ValueError(f"request {uid}: token ids {bad} are outside the vocabulary [0, "
                             f"{self.engine.config.model_config.vocab_size})") from None

    def _release(self, r: _Running) -> None:
        self.pages.free(r.pages)
        del self.row_pages[r.req.table_idx]
        self.free_rows.append(r.req.table_idx)

    # ---------------------------------------------------------------------------------------- scheduling
    def _schedule(self, waiting: Deque, running: List[_Running], on_logits: LogitsHook | None) -> List[_Step]:
        """The next steps from what the host knows: requests whose last token is launched, or that were seen to
        stop at EOS, give their slot and pages back first (stream order keeps their in-flight writes before any
        later use); then a prefill of whatever fits (mixed: after every running request's decode), else a decode.
        Alternating steps: a decode first if the last step carried a chunk and requests are decoding."""
        t0 = time.perf_counter()
        done = [r.launched >= r.max_tokens or bool(r.result.finish_reason) for r in running]
        for r in (r for r, d in zip(running, done) if d):
            self._release(r)
        running[:] = [r for r, d in zip(running, done) if not d]
        decoding = [r for r in running if not r.prefilling]
        yield_to_decode, self._after_chunk = self._after_chunk and bool(decoding), False
        if self.mixed or not yield_to_decode:
            step = self._prefill_step(waiting, running, decoding, on_logits, t0)
            if step is not None:
                return [step]
        if not decoding:
            return []
        return [self._make_step("decode", [r.req for r in decoding], decoding, on_logits, t0, len(decoding))]

    def _prefill_step(self, waiting: Deque, running: List[_Running], decoding: List[_Running],
                      on_logits: LogitsHook | None, t0: float) -> _Step | None:
        """The next chunks of prompts under way, then newly admitted requests, within the budget: the step's tokens
        and, in a mixed step, after the decodes of every running request, the step budget's allowance."""
        rows = decoding if self.mixed else []
        tokens = self.max_prefill_tokens - len(rows)
        allowance = self.budget.allowance(len(rows), sum(r.req.device_len for r in rows)) if rows else math.inf
        chunks: List[Req] = []  # chunks that are not their prompt's last: nothing of theirs is sampled
        members: List[_Running] = []
        under_way = [r for r in running if r.prefilling]
        while tokens > 0 and (allowance > 0 or not (chunks or members)):
            admitting = not under_way
            if not admitting and self.engine.config.batch_invariant and self._own_chunk(under_way[0]) > tokens:
                break  # batch-invariant mode: a prompt's chunk is the one it gets alone, never what the step has left
            r = (self._admit(waiting, tokens, allowance, first=not (chunks or members)) if admitting
                 else under_way.pop(0))
            if r is None:
                break
            if admitting:
                running.append(r)
            start = r.req.cached_len
            req = self._next_chunk(r, tokens, allowance, bool(decoding) and not self.mixed)
            tokens -= req.extend_len
            allowance -= self.budget.cost.variable(req.extend_len, start)
            if req is r.req:  # its last chunk: the step samples its first token
                members.append(r)
            else:
                chunks.append(req)
        if not (chunks or members):
            return None
        self._after_chunk = bool(chunks)
        # the decodes, then the members lead the batch: the step's first sampled tokens are theirs (feed-back and
        # processing read them)
        return self._make_step("prefill", [r.req for r in rows + members] + chunks, rows + members, on_logits, t0,
                               len(rows))

    def _own_chunk(self, r: _Running) -> int:
        """The tokens of the request's next chunk in batch-invariant mode, as it would be alone: to its prefix length
        or its prompt's end, at most the budget, and decode_chunk_tokens for a prompt over the budget."""
        start, prompt_len = r.req.cached_len, len(r.result.prompt_ids)
        end = r.prefix_len if start < r.prefix_len < prompt_len else prompt_len
        limit = self.max_prefill_tokens
        if prompt_len > self.max_prefill_tokens:
            limit = min(limit, self.decode_chunk_tokens)
        return min(end, start + limit) - start

    def _next_chunk(self, r: _Running, tokens: int, allowance: float, alternating: bool) -> Req:
        """The request's next prefill chunk: the rest of its prompt (the request itself, which samples), or a
        chunk that ends at its prefix length (the prefix path), at the step's tokens or allowance (mixed) or, for a
        prompt over the budget in an alternating step while others decode, at decode_chunk_tokens (a request of its
        own that samples nothing the driver keeps)."""
        start, prompt_len = r.req.cached_len, len(r.result.prompt_ids)
        end = r.prefix_len if start < r.prefix_len < prompt_len else prompt_len
        limit = tokens
        if allowance < math.inf:
            limit = self.budget.chunk(allowance, start, limit)
        # batch-invariant mode: a prompt's chunks never follow whether others decode
        elif (alternating or self.engine.config.batch_invariant) and prompt_len > self.max_prefill_tokens:
            limit = min(limit, self.decode_chunk_tokens)
        end = min(end, start + limit)
        if end == prompt_len:
            return r.req
        r.req.cached_len = end  # launched with this step: the next chunk starts there
        return Req(r.req.input_ids[:end], r.req.table_idx, start, 1, r.req.uid, UNSAMPLED, None)

    def _make_step(self, phase: Phase, reqs: List[Req], members: List[_Running], on_logits: LogitsHook | None,
                   t0: float, decode_rows: int = 0) -> _Step:
        spans = [(r.uid, r.cached_len, r.extend_len) for r in reqs]
        record = StepRecord(phase, len(reqs), sum(n for _, _, n in spans), sum(s + n for _, s, n in spans), t0,
                            pairs=sum(pairs(n, s) for _, s, n in spans), decode_rows=decode_rows,
                            deepest=max(s + n for _, s, n in spans) if phase == "prefill" else 0)
        batch = Batch(reqs=reqs, phase=phase, return_logits="none" if on_logits is None else
                      ("all" if phase == "prefill" and self.prompt_logits else "last"))
        self.engine.graph_runner.pad_batch(batch)
        record.host["build"] = time.perf_counter() - t0
        return _Step(phase, members, spans, record, batch, decode_rows if phase == "prefill" else 0)

    def _decode_inputs(self, batch: Batch) -> torch.Tensor:
        """The inputs of the tokens sampled last step, gathered on the device at each request's (row, last
        position): flat indices into the token pool and the page table, and the positions, in one pinned buffer and
        one copy; the engine's graph runner gathers them (into the graph's static inputs when the batch replays
        one). Returns where this step's sampled tokens go (the next positions' flat indices)."""
        n = batch.size
        host = torch.empty(5 * n, dtype=torch.int32, pin_memory=pin(self.engine.device))
        a = host.numpy()
        flat, feed, pos = a[: 2 * n].view(np.int64), a[2 * n: 4 * n].view(np.int64), a[4 * n:]
        flat[:] = self._last_flat(batch.reqs)
        feed[:] = flat + 1
        pos[:] = flat % self.token_pool.shape[1]
        dev = host.to(self.engine.device, non_blocking=True)
        self.engine.graph_runner.gather_decode_inputs(batch, dev[: 2 * n].view(torch.int64), dev[4 * n:],
                                                      self.token_pool)
        return dev[2 * n: 4 * n].view(torch.int64)

    def _last_flat(self, reqs: List[Req]) -> np.ndarray:
        """Each request's last position as a flat index into the token pool (and the page table): row * width +
        position."""
        width = self.token_pool.shape[1]
        return np.fromiter((r.table_idx * width + r.device_len - 1 for r in reqs), np.int64, len(reqs))

    def _prefill_inputs(self, batch: Batch, decode_rows: int) -> None:
        """Ids, positions and KV slots of the batch's new tokens, in one pinned buffer laid out as the device inputs
        they go to (the static inputs of the graph the batch replays, padded to its bucket) and one copy. The first
        decode_rows requests decode (a mixed step): their ids, sampled by a step the host may not have read yet, are
        gathered from the token pool on the device afterwards (stream order puts the sampling step's feed-back
        first)."""
        n = sum(r.extend_len for r in batch.reqs)
        runner = self.engine.graph_runner
        host, ids, pos, slots = runner.host_inputs(batch, n, pin(self.engine.device))
        if decode_rows:  # ids and KV slots come from the device below
            flat = self._last_flat(batch.reqs[:decode_rows])
            ids[:decode_rows], slots[:decode_rows] = 0, 0
            pos[:decode_rows] = flat % self.token_pool.shape[1]
        start = decode_rows
        for r in batch.reqs[decode_rows:]:
            span = np.arange(r.cached_len, r.device_len)
            end = start + len(span)
            ids[start:end] = r.input_ids[r.cached_len: r.device_len].numpy()
            pos[start:end] = span
            slots[start:end] = self._slots(r.table_idx, span)
            start = end
        runner.stage_inputs(batch, host, n)
        if decode_rows:
            at = pinned(flat, torch.int64, self.engine.device).to(self.engine.device, non_blocking=True)
            batch.input_ids[:decode_rows] = self.token_pool.view(-1).index_select(0, at)
            batch.out_loc[:decode_rows] = self.engine.page_table.view(-1).index_select(0, at)

    def _slots(self, row: int, positions: np.ndarray) -> np.ndarray:
        pages = self.row_pages[row]
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size

    # ---------------------------------------------------------------------------------------- launch / process
    def _launch(self, step: _Step) -> None:
        eng, batch, host = self.engine, step.batch, step.record.host
        # The step's inputs go to the device here, not when the step is built: a graph batch's go straight into the
        # graph's static inputs, which a step built before the previous one launched (an extend after its prefix
        # step) would overwrite under the previous one's replay. Counted as building.
        t = time.perf_counter()
        if step.phase == "decode":  # its members are its requests, in order
            step.feed = self._decode_inputs(batch)
        else:
            self._prefill_inputs(batch, step.decode_rows)
        host["build"] += time.perf_counter() - t
        t = time.perf_counter()
        eng.attn_backend.prepare_metadata(batch)
        host["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        args = eng.sampler.prepare(batch)
        host["sample_prep"] = time.perf_counter() - t
        t = time.perf_counter()
        step.out = eng.forward_batch(batch, args)
        if step.members:  # the next decode reads each request's new token at its new last position
            self._feed_back(step)
        for r in step.members:
            r.launched += 1
        host["launch"] = time.perf_counter() - t
        self.steps.append(step.record)

    def _feed_back(self, step: _Step) -> None:
        """The sampled tokens into the token pool at their positions (forward_batch moved each request on: its last
        position is now the sampled token's), and teacher-forced tokens over them."""
        members = step.members
        feed = step.feed
        if feed is None:
            feed = pinned(self._last_flat([r.req for r in members]), torch.int64,
                          self.engine.device).to(self.engine.device, non_blocking=True)
        pool = self.token_pool.view(-1)
        pool.index_copy_(0, feed, step.out.next_tokens_gpu[: len(members)])
        forced = [(i, r.forced[r.launched]) for i, r in enumerate(members) if r.forced is not None]
        if forced:
            idx, tokens = zip(*forced)
            pool.index_copy_(0, feed[make_device_tensor(list(idx), torch.int64, self.engine.device)],
                             make_device_tensor(list(tokens), torch.int32, self.engine.device))

    def _process(self, step: _Step, hooks: _Hooks) -> None:
        t = time.perf_counter()
        step.out.copy_done_event.synchronize()
        read = time.perf_counter()  # when the host has the step's tokens
        step.record.host["wait"] = read - t
        t = time.perf_counter()
        on_logits, on_router = hooks.on_logits, hooks.on_router
        if on_logits is not None:
            logprobs = torch.log_softmax(step.out.logits, dim=-1)
            stopped = {r.result.uid for r in step.members if r.result.finish_reason}  # a wasted slot-step's rows
            every = step.batch.return_logits == "all"
            sampled = {r.result.uid for r in step.members}
            offset = 0
            margins = step.out.router_margins if on_router is not None else None
            for uid, start, rows in step.spans:  # positions [cached_len, device_len) as they were before the forward
                n = rows if every else 1  # "last": one row per request, its last position's
                # "last" hands over prompts' last positions only, not a chunk's that ends within its prompt
                if uid not in stopped and (every or uid in sampled):
                    on_logits(uid, start + rows - n, logprobs[offset: offset + n])
                    if margins is not None:
                        on_router(uid, start + rows - n, margins[offset: offset + n])
                offset += n
        tokens = step.out.next_tokens_cpu.tolist()
        for r, tok in zip(step.members, tokens):
            if r.result.finish_reason:  # stopped at EOS a step ago: this was the wasted slot-step
                continue
            if tok == INVALID_TOKEN:
                raise RuntimeError(f"request {r.req.uid}: the logits had no finite maximum (NaN or all -inf) at "
                                   f"position {len(r.result.prompt_ids) + len(r.result.output_ids) - 1}")
            out = r.result.output_ids
            out.append(tok)
            if len(out) >= r.max_tokens:
                r.result.finish_reason = "length"
            elif r.forced is None and not r.req.sampling_params.ignore_eos and tok in hooks.eos:
                r.result.finish_reason = "eos"
            if hooks.on_token is not None:
                hooks.on_token(r.result.uid, tok, read)
            if r.result.finish_reason:
                hooks.on_finish(r.result)
        step.record.host["process"] = time.perf_counter() - t

    # ---------------------------------------------------------------------------------------- helpers
    def _close_records(self, first: int) -> None:
        end = time.perf_counter()
        records = self.steps[first:]
        for a, b in zip(records, records[1:] + [None]):
            a.seconds = (b.start if b is not None else end) - a.start
