"""The attention checks' cases and inputs: a paged KV pool, a page table and requests laid out as the driver lays
them (shuffled pages and rows, lengths across page boundaries), the step's merged q/k/v projection, and the batch.

Everything random is drawn once per case on the CPU from the case's seed, in bf16, then moved to the device: both
backends and the exact reference read the very same values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Literal, Tuple

import numpy as np
import torch

from engine.core import Batch, Req
from engine.kvcache import KVCachePool
from engine.models.config import ModelConfig, RotaryConfig
from engine.utils.misc import align_up

Phase = Literal["prefill", "extend", "decode", "graph"]
PHASES: Tuple[Phase, ...] = ("prefill", "extend", "decode", "graph")
PAGE_SIZES = (1, 4, 16)
HEAD_DIMS = (64, 128, 256)
WINDOW = 24  # a sliding layer's query sees its own key and WINDOW - 1 before it; it binds on the longer requests
GRAPH_BS = 8  # the captured batch size: the graph phase's 5 requests are padded with 3 dummy rows

# (cached_len, extend_len) per request: lengths cross pages of 4 and 16; the longest pass the window
SHAPES = {
    "prefill": [(0, 1), (0, 7), (0, 16), (0, 33), (0, 70)],
    "extend": [(5, 1), (16, 9), (31, 4), (64, 17)],
    "decode": [(16, 1), (40, 1), (63, 1), (100, 1), (150, 1)],  # last pages of 1 token, and full ones (64)
    "graph": [(16, 1), (40, 1), (63, 1), (100, 1), (150, 1)],
}
# q ~ N(0, Q_STD^2), k ~ N(0, 1): scores of std Q_STD, a softmax neither flat nor one-hot, where the output moves
# most with the softmax scale (decode contexts are long for the same reason: a 2-key softmax hardly moves)
Q_STD = 1.5


@dataclass(frozen=True)
class AttentionCase:
    phase: Phase  # prefill; extend over a cached prefix; decode eager; decode replayed from a CUDA graph
    page_size: int
    head_dim: int
    # 4 q heads per KV head selects FlashInfer's tensor-core decode (the backend's rule), 2 its plain decode kernel
    tensor_cores: bool
    window: int | None  # None: one full-attention layer; else a full layer and a sliding one (two plans per step)
    seed: int = 0

    @property
    def heads(self) -> Tuple[int, int]:
        return (8, 2) if self.tensor_cores else (4, 2)

    @property
    def name(self) -> str:
        return (f"{self.phase}-page{self.page_size}-d{self.head_dim}-{'tc' if self.tensor_cores else 'plain'}"
                f"{'' if self.window is None else f'-w{self.window}'}")


# Tensor-core decode runs FlashInfer's fa2 prefill kernels; the prebuilt sm90a set holds them for head_dim 256 only
# (Gemma 3, the zoo's model with 4 q heads per KV head), so the tensor-core decode cases stay at that head_dim.
TENSOR_CORE_DECODE_HEAD_DIMS = (256,)


def attention_cases() -> List[AttentionCase]:
    """The grid: every phase x page size x head_dim x decode kernel x window (tensor-core decode: see above)."""
    return [AttentionCase(p, ps, d, tc, w) for p, ps, d, tc, w in
            itertools.product(PHASES, PAGE_SIZES, HEAD_DIMS, (False, True), (None, WINDOW))
            if not (tc and p in ("decode", "graph") and d not in TENSOR_CORE_DECODE_HEAD_DIMS)]


def model_config(case: AttentionCase, scale_factor: float = 1.0) -> ModelConfig:
    """A one- or two-layer config holding what the backends read: heads, head_dim, layer windows, softmax scale."""
    hq, hkv = case.heads
    layer_types = ("full",) if case.window is None else ("full", "sliding")
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=1, hidden_size=hq * case.head_dim, intermediate_size=1,
        num_layers=len(layer_types), num_qo_heads=hq, num_kv_heads=hkv, head_dim=case.head_dim, rms_norm_eps=1e-6,
        rotary_config=RotaryConfig(case.head_dim, 1, 1e4, None), tie_word_embeddings=False, qk_norm=False,
        attention_bias=False, hidden_act="silu", layer_types=layer_types, sliding_window=case.window,
        attn_scale=case.head_dim ** -0.5 * scale_factor)


@dataclass
class PagedInputs:
    case: AttentionCase
    config: ModelConfig
    reqs: List[Req]
    dummy: Req  # pads the graph phase; its page-table row points at the dummy page
    num_pages: int  # real pages; page num_pages is the dummy's
    page_table: torch.Tensor  # [rows + 1, width] int32 on the device: token slots, the last row the dummy's
    keys: List[List[torch.Tensor]]  # [layer][request] [kv_len, Hkv, D] bf16: every position's K
    values: List[List[torch.Tensor]]
    qkv: List[torch.Tensor]  # [layer] [padded tokens, (Hq + 2 Hkv) D] bf16: the step's merged projection
    positions: torch.Tensor  # [padded tokens] int32 (padding rows: 0)
    out_loc: torch.Tensor  # [padded tokens] int64 (padding rows: the dummy slot)

    @property
    def num_tokens(self) -> int:
        """The real requests' tokens (the padding rows follow them)."""
        return sum(r.extend_len for r in self.reqs)

    @property
    def dummy_slot(self) -> int:
        return self.num_pages * self.case.page_size

    def views(self, layer: int, qkv: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D] and kv [N, 2, Hkv, D]: strided views of the merged projection, as the decoder makes them."""
        qkv = self.qkv[layer] if qkv is None else qkv
        hq, hkv = self.case.heads
        d, n = self.case.head_dim, qkv.shape[0]
        return qkv[:, : hq * d].view(n, hq, d), qkv[:, hq * d:].view(n, 2, hkv, d)

    def new_pool(self) -> KVCachePool:
        """A zeroed pool holding every request's cached prefix at its slots (the step's tokens are the kernel's)."""
        hkv, d = self.case.heads[1], self.case.head_dim
        pool = KVCachePool(self.config.num_layers, self.num_pages + 1, self.case.page_size, hkv, d,
                           self.page_table.device, self.keys[0][0].dtype)
        for layer in range(self.config.num_layers):
            for r, k, v in zip(self.reqs, self.keys[layer], self.values[layer]):
                if r.cached_len:
                    slots = self.page_table[r.table_idx, : r.cached_len].long()
                    pool.store_kv(torch.stack([k[: r.cached_len], v[: r.cached_len]], dim=1), slots, layer)
        return pool

    def batch(self, misplaced: float = 0.0) -> Batch:
        """The step's batch, padded as GraphRunner pads it in the graph phase. misplaced: the fraction of tokens
        (at least one when > 0) whose position and slot name the previous position's (a planted kv_slot fault)."""
        phase = "decode" if self.case.phase in ("decode", "graph") else "prefill"
        batch = Batch(reqs=list(self.reqs), phase=phase)
        pad = GRAPH_BS - len(self.reqs) if self.case.phase == "graph" else 0
        batch.padded_reqs = batch.reqs + [self.dummy] * pad
        batch.no_prefix = phase == "prefill" and not any(r.cached_len for r in self.reqs)  # as GraphRunner sets it
        positions, out_loc = self.positions.clone(), self.out_loc.clone()
        if misplaced > 0.0:
            eligible = np.flatnonzero(self.positions[: self.num_tokens].cpu().numpy() >= 1)
            count = min(len(eligible), max(1, round(misplaced * self.num_tokens)))
            chosen = eligible[np.linspace(0, len(eligible) - 1, count).round().astype(np.int64)]
            rows = torch.cat([torch.full((r.extend_len,), r.table_idx) for r in self.reqs])[chosen]
            idx = torch.from_numpy(chosen).to(positions.device)
            positions[idx] -= 1
            out_loc[idx] = self.page_table[rows.to(positions.device), positions[idx].long()].long()
        batch.input_ids = torch.zeros_like(positions)
        batch.positions, batch.out_loc = positions, out_loc
        return batch


def _bf16(gen: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)


def build(case: AttentionCase, device: torch.device | str) -> PagedInputs:
    """Draw the case's pool layout and values (seeded, on the CPU), then move them to the device."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(case.seed)
    rng = np.random.default_rng(case.seed)
    config = model_config(case)
    ps, shapes = case.page_size, SHAPES[case.phase]
    hq, hkv = case.heads
    d = case.head_dim
    lens = [c + e for c, e in shapes]
    pages_each = [-(-n // ps) for n in lens]
    num_pages = sum(pages_each) + 3  # a few free pages: requests do not tile the pool
    page_ids = rng.permutation(num_pages)
    rows = rng.permutation(len(shapes) + 2)[: len(shapes)]  # rows out of order, some rows unused
    num_rows = len(shapes) + 2
    width = align_up(max(lens), 32)
    table = np.zeros((num_rows + 1, width), dtype=np.int32)
    table[num_rows] = num_pages * ps  # the dummy row: every position -> the dummy page
    reqs, start = [], 0
    for i, ((cached, ext), n, npages) in enumerate(zip(shapes, lens, pages_each)):
        pages = page_ids[start: start + npages]
        start += npages
        span = np.arange(npages * ps)
        table[rows[i], : len(span)] = pages[span // ps] * ps + span % ps
        reqs.append(Req(input_ids=torch.zeros(n, dtype=torch.int32), table_idx=int(rows[i]), cached_len=cached,
                        output_len=1, uid=i, sampling_params=None, cache_handle=None))  # type: ignore[arg-type]
    dummy = Req(input_ids=torch.zeros(1, dtype=torch.int32), table_idx=num_rows, cached_len=0, output_len=1, uid=-1,
                sampling_params=None, cache_handle=None)  # type: ignore[arg-type]
    pad = GRAPH_BS - len(shapes) if case.phase == "graph" else 0
    keys, values, qkv = [], [], []
    for _ in range(config.num_layers):
        keys.append([_bf16(gen, n, hkv, d) for n in lens])
        values.append([_bf16(gen, n, hkv, d) for n in lens])
        q = _bf16(gen, sum(e for _, e in shapes) + pad, hq * d, std=Q_STD)
        new_k = torch.cat([k[c:] for k, (c, _) in zip(keys[-1], shapes)] + [_bf16(gen, pad, hkv, d)])
        new_v = torch.cat([v[c:] for v, (c, _) in zip(values[-1], shapes)] + [_bf16(gen, pad, hkv, d)])
        qkv.append(torch.cat([q, new_k.flatten(1), new_v.flatten(1)], dim=1).to(device))
    positions = np.concatenate([np.arange(c, c + e) for c, e in shapes] + [np.zeros(pad, dtype=np.int64)])
    slots = np.concatenate([table[rows[i], c: c + e] for i, (c, e) in enumerate(shapes)]
                           + [np.full(pad, num_pages * ps, dtype=np.int32)])
    return PagedInputs(
        case=case, config=config, reqs=reqs, dummy=dummy, num_pages=num_pages,
        page_table=torch.from_numpy(table).to(device),
        keys=[[k.to(device) for k in layer] for layer in keys],
        values=[[v.to(device) for v in layer] for layer in values],
        qkv=qkv, positions=torch.from_numpy(positions).int().to(device),
        out_loc=torch.from_numpy(slots.astype(np.int64)).to(device))
