"""The attention backend interface: metadata per batch, then one call per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List

import torch

from engine.core import Batch
from engine.models.config import ModelConfig


@dataclass
class BaseAttnMetadata:
    cu_seqlens_q: torch.Tensor  # [padded_bs + 1] int32 on the device: request i's tokens are [cu[i], cu[i+1])

    def last_indices(self) -> torch.Tensor:
        return self.cu_seqlens_q[1:] - 1


def layer_windows(config: ModelConfig) -> List[int | None]:
    """Per layer, the keys a query sees on a sliding layer (its own and window - 1 before it), None for full."""
    return [config.sliding_window if t == "sliding" else None for t in config.layer_types]


class AttentionBackend(ABC):
    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Set batch.attn_metadata from batch.padded_reqs and the page table (before forward)."""

    # whether prefills without a cached prefix (batch.no_prefix) attend over the step's own K and V (forward's kv)
    # through a kernel of their own, with CUDA graphs of their own
    ragged_prefill = False

    def own_kv(self, batch: Batch) -> bool:
        """Whether this batch's attention reads forward's kv rather than the pool."""
        return self.ragged_prefill and batch.is_prefill and batch.no_prefix

    @abstractmethod
    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """q [N, Hq, D] -> [N, Hq * D], over the pool, which already holds the batch's own K and V at batch.out_loc
        (the attention layer's ops store them); kv [N, 2, Hkv, D] holds them too (K normalized and rotated)."""

    # CUDA-graph hooks: static metadata buffers captured once, refilled before each replay.
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError

    def graph_prologue(self, batch: Batch) -> None:
        """Device work of the metadata that reads only static buffers, run inside a graph before the model (so that
        its replay does it, not the host before it); nothing by default."""

    def init_prefill_graphs(self, max_reqs: int, max_tokens: int, max_seq_len: int, dummy_row: int) -> None:
        """Static buffers for prefill graphs of up to max_reqs requests and max_tokens tokens; prepare_metadata
        then plans a batch with padded_tokens set into them."""
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")
