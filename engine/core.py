"""Requests, batches and the one place global state lives: the forward Context."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, List, Literal, Protocol

import torch

if TYPE_CHECKING:
    from engine.kvcache import KVCachePool


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 (or top_k 1) is greedy; top_k -1 and top_p 1 and min_p 0 mean no limit."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    ignore_eos: bool = False
    max_tokens: int = 1024
    seed: int | None = None  # a request with a seed draws the same tokens from the same prompt in any batch

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (no limit) or an integer >= 1, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2 ** 63 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(eq=False)
class Req:
    """One request's state on one rank. input_ids grows on the host as tokens are appended.

    Invariant: tokens [0, cached_len) have KV in the pool; [cached_len, device_len) are the next forward's input.
    """

    input_ids: torch.Tensor  # [device_len] int32 on the CPU
    table_idx: int  # row of the page table
    cached_len: int
    output_len: int  # how many tokens this request may still produce
    uid: int
    sampling_params: SamplingParams
    cache_handle: Any

    def __post_init__(self) -> None:
        assert self.input_ids.device.type == "cpu", "Req.input_ids lives on the host"
        if len(self.input_ids) == 0:
            raise ValueError(f"request {self.uid}: the prompt is empty (at least one token is needed)")
        self.device_len = len(self.input_ids)
        self.max_device_len = len(self.input_ids) + self.output_len
        assert 0 <= self.cached_len < self.device_len <= self.max_device_len

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    def complete_one(self) -> None:
        """The forward pass consumed [cached_len, device_len); its sampled token becomes the next input."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, next_token: torch.Tensor) -> None:
        self.input_ids = torch.cat([self.input_ids, next_token.to(self.input_ids.dtype)])


Phase = Literal["prefill", "decode"]
LogitsMode = Literal["none", "last", "all"]


@dataclass(eq=False)
class Batch:
    reqs: List[Req]
    phase: Phase
    # Which logits forward_batch hands back besides the tokens: none, the sampled row per request, or every position.
    return_logits: LogitsMode = "none"
    # Filled by the caller (scheduler or harness driver) before forward_batch:
    input_ids: torch.Tensor = field(init=False)  # [num_tokens] int32, the packed extend tokens
    positions: torch.Tensor = field(init=False)  # [num_tokens] int32
    out_loc: torch.Tensor = field(init=False)  # [num_tokens] int64 (int32 is converted), KV slot each token writes
    # Filled by GraphRunner.pad_batch and the attention backend:
    padded_reqs: List[Req] = field(init=False)
    # a prefill batch that replays a CUDA graph: the graph's token count (its tokens padded up to it), else 0
    padded_tokens: int = field(init=False, default=0)
    # a prefill whose requests have no cached prefix: its attention may read the step's own K and V, not the pool
    no_prefix: bool = field(init=False, default=False)
    attn_metadata: Any = field(init=False, default=None)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def padded_size(self) -> int:
        return len(self.padded_reqs)


class AttentionForward(Protocol):
    """What the layers call on the Context's attention backend (engine.attention.base.AttentionBackend implements
    it); stated here so that core, which the backends import, imports none of them."""

    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor: ...


class MoEForward(Protocol):
    """What a MoE layer calls on the Context's MoE backend (engine.moe.base.MoEBackend implements it)."""

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_k: int, renormalize: bool, weights_fp32: bool, act: str) -> torch.Tensor: ...


@dataclass
class Context:
    """What the layers read during a forward: the batch, the KV pool, the page table, the attention and MoE
    backends."""

    page_size: int
    kv_cache: KVCachePool | None = None
    page_table: torch.Tensor | None = None  # [max_running_req + 1, aligned_max_seq_len] int32 token slots
    attn_backend: AttentionForward | None = None
    moe_backend: MoEForward | None = None
    # [max rows of a forward, MoE layers] float32 when EngineConfig.record_router_margins: each MoE layer writes its
    # tokens' router margin (engine.moe.router_margin) into its column; a static buffer, so graphs record it too
    router_margins: torch.Tensor | None = None
    _batch: Batch | None = None

    @property
    def batch(self) -> Batch:
        assert self._batch is not None, "no batch is being forwarded"
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        assert self._batch is None, "forward_batch contexts do not nest"
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context | None) -> None:
    global _GLOBAL_CTX
    if ctx is not None and _GLOBAL_CTX is not None:
        raise RuntimeError("an Engine is already live in this process: call its shutdown() first")
    _GLOBAL_CTX = ctx


def has_global_ctx() -> bool:
    return _GLOBAL_CTX is not None


def forwarding_prefill() -> bool:
    """Whether the forward under way (if any) is a prefill or extend."""
    return _GLOBAL_CTX is not None and _GLOBAL_CTX._batch is not None and _GLOBAL_CTX._batch.is_prefill


def get_global_ctx() -> Context:
    assert _GLOBAL_CTX is not None, "no Engine is live in this process"
    return _GLOBAL_CTX
