"""The driver: what the spec's hand-driven loop does, automated, with continuous batching.

It owns request slots (page-table rows) and KV pages, builds each batch's positions / input_ids / out_loc,
appends tokens, finishes requests at max_tokens or an EOS id, and returns their pages. Prefill batches run first
whenever a waiting request fits; otherwise every running request decodes one token.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, List, Literal, Sequence

import torch

from engine import Engine
from engine.core import Batch, Req, SamplingParams
from engine.sample import INVALID_TOKEN

logger = logging.getLogger(__name__)

# (uid, first position of these rows, logprobs [rows, vocab] float32) -> None
LogitsHook = Callable[[int, int, torch.Tensor], None]


@dataclass
class StepRecord:
    """One forward as the driver saw it: host preparation, forward, sampling, and the copy back, synchronized."""

    phase: Literal["prefill", "decode"]
    batch_size: int
    num_tokens: int  # tokens fed to the model
    kv_tokens: int  # tokens of KV attended over (sum of device_len)
    seconds: float


@dataclass
class GenResult:
    uid: int
    prompt_ids: List[int]
    output_ids: List[int] = field(default_factory=list)  # what the engine sampled at each step
    finish_reason: Literal["length", "eos", ""] = ""


@dataclass
class _Running:
    req: Req
    result: GenResult
    pages: List[int]
    forced: List[int] | None
    max_tokens: int
    prefix_len: int = 0  # > 0: the prompt's first prefix_len tokens are prefilled on their own first


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free_pages: Deque[int] = deque(range(num_pages))

    def alloc(self, n: int) -> List[int]:
        assert n <= len(self.free_pages)
        return [self.free_pages.popleft() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        self.free_pages.extend(pages)

    def check_no_leak(self) -> None:
        if len(self.free_pages) != self.num_pages or len(set(self.free_pages)) != self.num_pages:
            raise AssertionError(f"KV pages leaked: {len(self.free_pages)} of {self.num_pages} free")


def eos_token_ids(model_path: str | Path) -> List[int]:
    """Every EOS id of the model's generation config (it may list several)."""
    cfg = Path(model_path) / "generation_config.json"
    if not cfg.is_file():
        return []
    eos = json.loads(cfg.read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


class Driver:
    def __init__(self, engine: Engine, max_prefill_tokens: int = 4096) -> None:
        self.engine = engine
        self.max_prefill_tokens = min(max_prefill_tokens, engine.config.max_forward_len)
        self.page_size = engine.config.page_size
        self.pages = PageAllocator(engine.num_pages)
        self.free_rows: Deque[int] = deque(range(engine.config.max_running_req))
        self.row_slots: Dict[int, torch.Tensor] = {}  # host copy of each occupied page-table row
        self.steps: List[StepRecord] = []  # every forward, for benchmarks

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 eos_ids: Sequence[int] = (), forced: Sequence[Sequence[int]] | None = None,
                 prefix_lens: Sequence[int] | None = None, on_logits: LogitsHook | None = None) -> List[GenResult]:
        """Run every prompt to completion; results in prompt order.

        forced: feed these tokens instead of the sampled ones (teacher forcing); each request then makes
        len(forced[i]) steps. prefix_lens: prefill that many prompt tokens first, then the rest as an extend over
        the cached prefix. on_logits: receives log-probabilities at every prefill and decode position.
        """
        n = len(prompts)
        plist = list(params) if isinstance(params, Sequence) else [params] * n
        if len(plist) != n or (forced is not None and len(forced) != n):
            raise ValueError("prompts, params and forced must have the same length")
        waiting: Deque[tuple] = deque(
            (uid, list(map(int, prompts[uid])), plist[uid], None if forced is None else list(forced[uid]),
             0 if prefix_lens is None else prefix_lens[uid]) for uid in range(n))
        for uid, prompt, p, f, _ in waiting:
            self._check_fits(uid, len(prompt), len(f) if f is not None else p.max_tokens)
        results: Dict[int, GenResult] = {}
        running: List[_Running] = []
        while waiting or running:
            admitted = self._admit(waiting)
            if admitted:
                self._prefill(admitted, on_logits)
                running += admitted
            else:
                self._step(running, "decode", on_logits)
            self._finish(running, eos_ids)
            for r in [r for r in running if r.result.finish_reason]:
                running.remove(r)
                self._release(r)
                results[r.result.uid] = r.result
        self.pages.check_no_leak()
        return [results[uid] for uid in range(n)]

    # ---------------------------------------------------------------------------------------- admission
    def _check_fits(self, uid: int, prompt_len: int, max_tokens: int) -> None:
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
        if prompt_len > self.engine.config.max_forward_len:  # a prompt over the budget is admitted alone, up to this
            raise ValueError(f"request {uid}: prompt of {prompt_len} tokens exceeds the engine's max_forward_len "
                             f"{self.engine.config.max_forward_len} (prefills are not chunked); raise "
                             "EngineConfig.max_prefill_tokens")
        if -(-need // self.page_size) > self.pages.num_pages:
            raise ValueError(f"request {uid}: needs {need} KV slots but the pool holds only "
                             f"{self.pages.num_pages * self.page_size}; raise num_page_override or memory_ratio")

    def _admit(self, waiting: Deque) -> List[_Running]:
        """Admit waiting requests while a slot, their pages (for the whole request) and the token budget allow."""
        admitted: List[_Running] = []
        budget = self.max_prefill_tokens
        while waiting and self.free_rows:
            uid, prompt, p, f, prefix_len = waiting[0]
            max_tokens = len(f) if f is not None else p.max_tokens
            npages = -(-(len(prompt) + max_tokens) // self.page_size)
            if npages > len(self.pages.free_pages) or (admitted and len(prompt) > budget):
                break
            waiting.popleft()
            budget -= len(prompt)
            row, pages = self.free_rows.popleft(), self.pages.alloc(npages)
            slots = (torch.tensor(pages, dtype=torch.int32)[:, None] * self.page_size
                     + torch.arange(self.page_size, dtype=torch.int32)).flatten()
            self.engine.page_table[row, : len(slots)] = slots.to(self.engine.device)
            self.row_slots[row] = slots
            req = Req(input_ids=torch.tensor(prompt, dtype=torch.int32), table_idx=row, cached_len=0,
                      output_len=max_tokens, uid=uid, sampling_params=p, cache_handle=None)
            admitted.append(_Running(req, GenResult(uid, prompt), pages, f, max_tokens, prefix_len))
        return admitted

    def _release(self, r: _Running) -> None:
        self.pages.free(r.pages)
        del self.row_slots[r.req.table_idx]
        self.free_rows.append(r.req.table_idx)

    # ---------------------------------------------------------------------------------------- stepping
    def _prefill(self, admitted: List[_Running], on_logits: LogitsHook | None) -> None:
        with_prefix = [r for r in admitted if 0 < r.prefix_len < len(r.result.prompt_ids)]
        if with_prefix:
            # The prefix alone, as its own request in the same row; the real request then starts with it cached.
            prefix_reqs = [Req(r.req.input_ids[: r.prefix_len], r.req.table_idx, 0, 1, r.req.uid,
                               r.req.sampling_params, None) for r in with_prefix]
            self._forward(prefix_reqs, "prefill", on_logits)
            for r in with_prefix:
                r.req = Req(r.req.input_ids, r.req.table_idx, r.prefix_len, r.max_tokens, r.req.uid,
                            r.req.sampling_params, None)
        self._step(admitted, "prefill", on_logits)

    def _step(self, running: List[_Running], phase: Literal["prefill", "decode"],
              on_logits: LogitsHook | None) -> None:
        tokens = self._forward([r.req for r in running], phase, on_logits)
        for r, tok in zip(running, tokens):
            if tok == INVALID_TOKEN:
                raise RuntimeError(f"request {r.req.uid}: the logits had no finite maximum (NaN or all -inf) at "
                                   f"position {r.req.device_len - 1}")
            r.result.output_ids.append(tok)
            step = len(r.result.output_ids) - 1
            nxt = r.forced[step] if r.forced is not None else tok
            r.req.append_host(torch.tensor([nxt], dtype=torch.int32))

    def _forward(self, reqs: List[Req], phase: Literal["prefill", "decode"],
                 on_logits: LogitsHook | None) -> List[int]:
        eng = self.engine
        t0 = time.perf_counter()
        mode = "none" if on_logits is None else ("all" if phase == "prefill" else "last")
        batch = Batch(reqs=reqs, phase=phase, return_logits=mode)
        eng.graph_runner.pad_batch(batch)
        dev = eng.device
        if phase == "decode":  # one token each: plain lists and a single host-to-device copy
            pos = [r.device_len - 1 for r in reqs]
            host = torch.tensor([pos, [int(r.input_ids[-1]) for r in reqs],
                                 [int(self.row_slots[r.table_idx][p]) for r, p in zip(reqs, pos)]],
                                dtype=torch.int32, pin_memory=dev.type == "cuda")
            batch.positions, batch.input_ids, batch.out_loc = host.to(dev, non_blocking=True).unbind(0)
        else:
            starts, ends = [r.cached_len for r in reqs], [r.device_len for r in reqs]
            batch.positions = torch.cat([torch.arange(s, e, dtype=torch.int32) for s, e in zip(starts, ends)]).to(dev)
            batch.input_ids = torch.cat([r.input_ids[s:e] for r, s, e in zip(reqs, starts, ends)]).to(dev)
            batch.out_loc = torch.cat([self.row_slots[r.table_idx][s:e] for r, s, e in zip(reqs, starts, ends)]).to(dev)
        spans = [(r, r.cached_len, r.extend_len) for r in reqs]
        eng.attn_backend.prepare_metadata(batch)
        out = eng.forward_batch(batch, eng.sampler.prepare(batch))
        if on_logits is not None:
            logprobs = torch.log_softmax(out.logits, dim=-1)
            offset = 0
            for r, start, rows in spans:  # positions [cached_len, device_len) as they were before the forward
                on_logits(r.uid, start, logprobs[offset: offset + rows])
                offset += rows
        out.copy_done_event.synchronize()
        tokens = out.next_tokens_cpu.tolist()
        self.steps.append(StepRecord(phase, len(reqs), sum(n for _, _, n in spans),
                                     sum(s + n for _, s, n in spans), time.perf_counter() - t0))
        return tokens

    def _finish(self, running: List[_Running], eos_ids: Sequence[int]) -> None:
        eos = set(eos_ids)
        for r in running:
            out = r.result.output_ids
            if len(out) >= r.max_tokens:
                r.result.finish_reason = "length"
            elif r.forced is None and not r.req.sampling_params.ignore_eos and out[-1] in eos:
                r.result.finish_reason = "eos"
