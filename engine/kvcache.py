"""The paged KV pool: every layer's K and V in one zeroed allocation, addressed by token slot."""

from __future__ import annotations

import torch


class KVCachePool:
    """Slot s lives in page s // page_size at offset s % page_size; layout per layer is FlashInfer's NHD.

    The last page belongs to the dummy request that pads CUDA-graph batches: its writes land there.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        # Zeroed, not empty: padded attention reads unwritten slots with weight 0, and 0 * NaN would poison it.
        self._kv = torch.zeros(2, num_layers, num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype)

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self._kv[0, layer_id]  # [num_pages, page_size, Hkv, D]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._kv[1, layer_id]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """k, v [N, Hkv, D] written at slots out_loc [N]."""
        self._kv[0, layer_id].view(-1, *k.shape[1:])[out_loc] = k
        self._kv[1, layer_id].view(-1, *v.shape[1:])[out_loc] = v


def create_kvcache_pool(model_config, num_pages: int, page_size: int, num_kv_heads: int, device: torch.device,
                        dtype: torch.dtype) -> KVCachePool:
    return KVCachePool(model_config.num_layers, num_pages, page_size, num_kv_heads, model_config.head_dim,
                       device, dtype)
