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

    def slots(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer addressed by token slot: [num_pages * page_size, Hkv, D] views each."""
        k, v = self._kv[:, layer_id].flatten(1, 2)  # [2, slots, Hkv, D]
        return k, v

    def store_kv(self, kv: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """kv [N, 2, Hkv, D] (K and V, any strides) written at slots out_loc [N] int64 by one index_copy_ (the
        reference ops' store; the fused ops write K and V in their q/k norm + RoPE kernel)."""
        pool = self._kv[:, layer_id].view(2, -1, *kv.shape[2:])  # [2, slots, Hkv, D]
        pool.index_copy_(1, out_loc, kv.transpose(0, 1))


def create_kvcache_pool(model_config, num_pages: int, page_size: int, num_kv_heads: int, device: torch.device,
                        dtype: torch.dtype) -> KVCachePool:
    return KVCachePool(model_config.num_layers, num_pages, page_size, num_kv_heads, model_config.head_dim,
                       device, dtype)
