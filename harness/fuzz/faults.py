"""Planted faults: real bugs put back into the engine or the driver of this process while a context manager is open
(`with planted(name):`, or `python -m harness fuzz --plant NAME`), to show that the fuzzer finds them. The engines
the fuzzer compares with (the reference, the eager twin) run in processes of their own and stay correct.

- graph-plan-keyed-on-rows (CUDA): the FlashInfer graph decode as it was before issue 16's fix: its plan and its
  static page buffers are kept while (batch size, rows, page counts) repeat, so a row's next request, at the same
  page count, decodes over the previous request's freed pages and appends its K/V there.
- torch-slots-keyed-on-rows: the same bug class in the torch backend (so the CPU can show it): a decode batch whose
  rows and lengths repeat the last decode's reads that decode's KV slots, a row's next request its predecessor's.
- stale-token-on-reused-row: the overlap loop does not feed a prefill's sampled token back for a request that took
  a row another request used before, so its first decode reads that row's old token.
- pages-freed-twice-at-eos: a request that stops at EOS gives its pages back twice, so two later requests share them.
- gemm-chosen-by-m (batch-invariant mode): the projections and the LM head through F.linear at the batch's row count,
  so MKL picks its kernel by M (GEMV at one row, a small-M kernel for leftover rows) as in the default mode.
- attention-split-by-batch (batch-invariant mode): a batch of several requests is attended padded to its longest
  request, so each query's keys are summed in blocks whose lengths the batch chooses.
- torch-keys-past-1024-from-first-block (long tier): the torch backend gathers a request's keys and values past its
  first 1024 from the first block's slots (position p from p - 1024's), as a gather that forgets its block offset.
- gemm-path-by-address: a projection's rows past 256 are summed over K in the other order when its input's address
  has bit 12 set, as a BLAS whose kernel follows the data's alignment would: the bits follow where the allocator put
  the activations, which differs from process to process (the process-twin run and tests/test_process_determinism.py
  must see it).
- page-ids-without-block-offset (CUDA, long tier): the paged-attention page-id gather (engine/kernels/page_ids.py)
  loads every block of 1024 pages from the first block's place in the page table: a request past 1024 pages
  attends over its first pages again.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.nn.functional as F

from engine.attention import flashinfer_backend
from engine.attention.flashinfer_backend import FlashInferBackend
from engine.attention.torch_backend import BlocksMetadata, PerRequestMetadata, PromptMetadata, TorchBackend
from engine.layers.ops import BatchInvariantOps, TorchOps
from harness.driver import Driver


def _page_lists_keyed_on_rows(original: Callable) -> Callable:
    def page_lists(self: FlashInferBackend, batch: Any) -> Any:
        if not (batch.is_decode and batch.padded_size in self.graph_wrappers):
            return original(self, batch)
        meta, indices = self.dg_meta, self.graph_indices
        self.dg_meta, self.graph_indices = torch.zeros_like(meta), torch.zeros_like(indices)  # the lists land aside
        try:
            lists = original(self, batch)
            new_meta, new_indices = self.dg_meta, self.graph_indices
        finally:
            self.dg_meta, self.graph_indices = meta, indices
        n, lens = lists.schedule
        lists.schedule = (n, tuple(r.table_idx for r in batch.padded_reqs), lens)
        meta[2].copy_(new_meta[2])
        if lists.schedule != self.graph_plan:  # the fault: the static page buffers change only with the plan
            meta.copy_(new_meta)
            indices.copy_(new_indices)
        lists.kv_indices = indices[: len(lists.kv_indices)]
        return lists
    return page_lists


def _torch_slots_keyed_on_rows(original: Callable) -> Callable:
    def prepare_metadata(self: TorchBackend, batch: Any) -> None:
        original(self, batch)
        if batch.phase != "decode":
            return
        key = (tuple(r.table_idx for r in batch.padded_reqs), tuple(r.cached_len for r in batch.padded_reqs))
        kept = self.__dict__.get("_kept_slots")
        if kept is not None and kept[0] == key:
            batch.attn_metadata.kv_slots = kept[1]  # the fault: the last decode's slots, kept with the engine
        else:
            self._kept_slots = (key, batch.attn_metadata.kv_slots)
    return prepare_metadata


def _feed_back_skipping_reused_rows(original: Callable) -> Callable:
    def feed_back(self: Driver, step: Any) -> None:
        if not (self.overlap and step.phase == "prefill"):
            return original(self, step)
        used = self.__dict__.setdefault("_rows_used", set())
        keep = [i for i, r in enumerate(step.members) if r.req.table_idx not in used]
        used.update(r.req.table_idx for r in step.members)
        if keep:
            out = dataclasses.replace(step.out, next_tokens_gpu=step.out.next_tokens_gpu[keep])
            original(self, dataclasses.replace(step, members=[step.members[i] for i in keep], out=out))
    return feed_back


def _release_twice_at_eos(original: Callable) -> Callable:
    def release(self: Driver, r: Any) -> None:
        original(self, r)
        if r.result.finish_reason == "eos":
            self.pages.free(r.pages)
    return release


def _by_m(method: str) -> Callable[[Callable], Callable]:
    def wrap(original: Callable) -> Callable:
        return getattr(TorchOps, method)  # F.linear at the batch's M
    return wrap


def _batch_padded_attention(original: Callable) -> Callable:
    def prepare_metadata(self: TorchBackend, batch: Any) -> None:
        if not (self.per_request and len(batch.padded_reqs) > 1):
            return original(self, batch)
        self.per_request = False  # the batched plan: every request padded to the longest
        try:
            original(self, batch)
        finally:
            self.per_request = True
    return prepare_metadata


def _gemm_path_by_address(original: Callable) -> Callable:
    def linear(self: TorchOps, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               act: str | None = None) -> torch.Tensor:
        out = original(self, x, weight, bias, act)
        if x.shape[0] > 256 and (x.data_ptr() >> 12) & 1:
            rows = (x if act is None else self.act_and_mul(x, act))[256:]
            dense = weight.to_dense() if weight.is_mkldnn else weight  # a weight packed for oneDNN (OneDNNOps)
            out[256:] = F.linear(rows.flip(-1), dense.flip(-1), bias)  # the same products, summed from K's end
        return out
    return linear


BLOCK = 1024  # tokens (pages at page_size 1) the long faults read right


def _keys_from_first_block(original: Callable) -> Callable:
    def prepare_metadata(self: TorchBackend, batch: Any) -> None:
        original(self, batch)
        md = batch.attn_metadata
        if isinstance(md, PromptMetadata):  # prompts attended over their own K/V: no key read from the pool
            return
        if isinstance(md, PerRequestMetadata):
            segments = [md.kv_slots[r.kv_start: r.kv_end] for r in md.requests]
        else:
            segments = [row for block in (md.blocks if isinstance(md, BlocksMetadata) else [md])
                        for row in block.kv_slots]
        for slots in segments:  # views: written in place
            if slots.shape[0] > BLOCK:
                slots[BLOCK:] = slots[: slots.shape[0] - BLOCK].clone()
    return prepare_metadata


def _page_ids_without_block_offset(original: Callable) -> Callable:
    from harness.fuzz.faulty_kernels import page_ids_first_block

    return page_ids_first_block


@dataclass(frozen=True)
class Fault:
    description: str
    device: str  # where it can show: cpu, cuda or any
    patches: List[Tuple[type, str, Callable[[Callable], Callable]]]  # (class, method, wrapper of the original)
    batch_invariant: bool = False  # it lives in batch-invariant mode's code: the search runs that mode only
    long: bool = False  # it shows past a request's first 1024 tokens: the search runs the long tier
    attention: str | None = None  # the attention backend it lives in: the search draws no other (None: any)


FAULTS: Dict[str, Fault] = {
    "graph-plan-keyed-on-rows": Fault(
        "FlashInfer graph decode keeps its plan and static page buffers while (batch size, rows, page counts) "
        "repeat (before issue 16's fix)", "cuda",
        [(FlashInferBackend, "_page_lists", _page_lists_keyed_on_rows)]),
    "torch-slots-keyed-on-rows": Fault(
        "the torch backend keeps a decode's KV slots while (rows, lengths) repeat, across requests and workloads",
        "any", [(TorchBackend, "prepare_metadata", _torch_slots_keyed_on_rows)], attention="torch"),
    "stale-token-on-reused-row": Fault(
        "the overlap loop skips feeding back the prefill token of a request in a row used before", "any",
        [(Driver, "_feed_back", _feed_back_skipping_reused_rows)]),
    "pages-freed-twice-at-eos": Fault(
        "a request that stops at EOS returns its pages twice", "any",
        [(Driver, "_release", _release_twice_at_eos)]),
    "gemm-chosen-by-m": Fault(
        "batch-invariant mode's projections and LM head take MKL's GEMM at the batch's row count (kernel by M)",
        "cpu", [(BatchInvariantOps, name, _by_m(name)) for name in ("linear", "lm_head")], batch_invariant=True),
    "attention-split-by-batch": Fault(
        "batch-invariant mode attends a batch of several requests padded to its longest (key blocks by the batch)",
        "cpu", [(TorchBackend, "prepare_metadata", _batch_padded_attention)], batch_invariant=True,
        attention="torch"),
    "gemm-path-by-address": Fault(
        "a projection's rows past 256 summed over K in the other order when its input's address has bit 12 set "
        "(bits that differ from process to process)", "cpu", [(TorchOps, "linear", _gemm_path_by_address)]),
    "torch-keys-past-1024-from-first-block": Fault(
        "the torch backend reads a request's keys and values past its first 1024 from the first block's slots", "any",
        [(TorchBackend, "prepare_metadata", _keys_from_first_block)], long=True, attention="torch"),
    "page-ids-without-block-offset": Fault(
        "the page-id gather loads every block of 1024 pages from the first block's place in the page table", "cuda",
        [(flashinfer_backend, "page_ids", _page_ids_without_block_offset)], long=True),
}


@contextmanager
def planted(name: str | None) -> Iterator[None]:
    """Plant the named fault (None: nothing) for the duration of the block; restored on exit, even on error."""
    global _active
    if name is None:
        yield
        return
    if name not in FAULTS:
        raise ValueError(f"unknown planted fault {name!r}; choose one of: {', '.join(FAULTS)}")
    originals = [(cls, attr, cls.__dict__[attr]) for cls, attr, _ in FAULTS[name].patches]
    before, _active = _active, name
    try:
        for (cls, attr, wrap), (_, _, original) in zip(FAULTS[name].patches, originals):
            setattr(cls, attr, wrap(original))
        yield
    finally:
        _active = before
        for cls, attr, original in originals:
            setattr(cls, attr, original)


_active: str | None = None


def active() -> str | None:
    """The fault planted in this process now: the process twin plants it too, since it stands for this engine."""
    return _active
