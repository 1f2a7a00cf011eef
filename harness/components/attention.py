"""Attention: the FlashInfer backend against the torch backend on the same paged pool and q.

Both backends go through the engine's own path: prepare_metadata on a real Batch of Req under a Context holding the
pool and the page table, then per layer the step's K and V stored at batch.out_loc (the torch side through
KVCachePool.store_kv, as the reference ops store them, the FlashInfer side through the fused ops' kernel) and forward,
which attends over the pool (FlashInfer's prefill phase, prompts without a prefix, over the step's own K and V: the
ragged kernel, where the GPU has FA3); the graph phase captures the backend's decode in a CUDA graph as GraphRunner does
(init_capture_graph, a dummy batch, prepare_for_capture, a warm-up, the capture) and replays it after
prepare_metadata and prepare_for_replay. Each side has its own copy of the pool, so the store is compared too.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Literal, Tuple

import torch

from engine.attention.base import AttentionBackend
from engine.attention.torch_backend import TorchBackend
from engine.core import Batch, Context, get_global_ctx, set_global_ctx
from engine.kernels import qk_rope_store
from engine.kvcache import KVCachePool
from harness.components import reference
from harness.components.measure import CheckResult, Fault, check_fault, measure, planted
from harness.components.paged import AttentionCase, PagedInputs, build, model_config

Kernel = Literal["flashinfer", "torch"]


@contextmanager
def _context(inputs: PagedInputs, pool: KVCachePool, backend: AttentionBackend) -> Iterator[Context]:
    """The one global Context, as an Engine installs it (refused while an Engine is live)."""
    ctx = Context(inputs.case.page_size, kv_cache=pool, page_table=inputs.page_table, attn_backend=backend)
    set_global_ctx(ctx)
    try:
        yield ctx
    finally:
        set_global_ctx(None)


def _backend(kernel: Kernel, inputs: PagedInputs, scale_factor: float) -> AttentionBackend:
    config = model_config(inputs.case, scale_factor)
    hq, hkv = inputs.case.heads
    if kernel == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(config, hq, hkv, inputs.page_table.device, torch.bfloat16)
    return TorchBackend(config)


def _forward(backend: AttentionBackend, inputs: PagedInputs, batch: Batch, qkv: List[torch.Tensor]) -> List:
    """Per layer the store, then attention. The FlashInfer side stores through the fused kernel the engine's fused
    ops use (kernels/qk_rope_store.py), without norms and with an identity rotation (cos 1, sin 0: K and q come out
    bit for bit as they went in), so the KV append check compares its writes bitwise with the torch store's."""
    pool, outs = get_global_ctx().kv_cache, []
    fused = not isinstance(backend, TorchBackend)
    if fused:
        d = inputs.case.head_dim
        identity = torch.cat([torch.ones(inputs.page_table.shape[1], d // 2, device=batch.positions.device),
                              torch.zeros(inputs.page_table.shape[1], d // 2, device=batch.positions.device)], -1)
    for layer, x in enumerate(qkv):
        q, kv = inputs.views(layer, x)
        if fused:
            qk_rope_store.qk_rope_store(batch.positions, q, kv, identity, None, None, 0.0, *pool.slots(layer),
                                        batch.out_loc)
        else:
            pool.store_kv(kv, batch.out_loc, layer)
        outs.append(backend.forward(q, kv, layer, batch))
    return outs


def _eager(backend: AttentionBackend, inputs: PagedInputs, ctx: Context, batch: Batch) -> List[torch.Tensor]:
    backend.prepare_metadata(batch)
    with ctx.forward_batch(batch):
        return _forward(backend, inputs, batch, inputs.qkv)


def _graph(backend: AttentionBackend, inputs: PagedInputs, ctx: Context, batch: Batch) -> List[torch.Tensor]:
    """Capture on a dummy batch of the padded size, then plan the real batch and replay (GraphRunner's order)."""
    bs = batch.padded_size
    static_qkv = [torch.zeros_like(x) for x in inputs.qkv]
    positions = torch.zeros(bs, dtype=torch.int32, device=batch.positions.device)
    out_loc = torch.full((bs,), inputs.dummy_slot, dtype=torch.int64, device=positions.device)
    stream = torch.cuda.Stream(positions.device)
    stream.wait_stream(torch.cuda.current_stream(positions.device))
    with torch.cuda.stream(stream):
        backend.init_capture_graph(inputs.page_table.shape[1], [bs])
        capture = Batch(reqs=[inputs.dummy] * bs, phase="decode")
        capture.padded_reqs = capture.reqs
        capture.input_ids, capture.positions, capture.out_loc = torch.zeros_like(positions), positions, out_loc
        backend.prepare_for_capture(capture)
        with ctx.forward_batch(capture):
            _forward(backend, inputs, capture, static_qkv)  # warm-up outside the capture, as GraphRunner does
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = _forward(backend, inputs, capture, static_qkv)
        backend.prepare_metadata(batch)
        for dst, src in zip(static_qkv, inputs.qkv):
            dst.copy_(src)
        positions.copy_(batch.positions)
        out_loc.copy_(batch.out_loc)
        backend.prepare_for_replay(batch)
        graph.replay()
        outs = [o.clone() for o in outs]
    stream.synchronize()
    return outs


def _run(kernel: Kernel, inputs: PagedInputs, fault: Fault | None) -> Tuple[List[torch.Tensor], KVCachePool]:
    """One side's outputs per layer (the real tokens' rows) and its pool after the step."""
    backend = _backend(kernel, inputs, 1.0 + planted(fault, "softmax_scale"))
    pool = inputs.new_pool()
    batch = inputs.batch(misplaced=planted(fault, "kv_slot"))
    with torch.inference_mode(), _context(inputs, pool, backend) as ctx:
        # the reference of a graph replay is the torch backend's eager decode of the same padded batch
        graphed = inputs.case.phase == "graph" and kernel == "flashinfer"
        outs = (_graph if graphed else _eager)(backend, inputs, ctx, batch)
    return [o[: inputs.num_tokens] for o in outs], pool


def _exact(inputs: PagedInputs, layer: int) -> torch.Tensor:
    window = inputs.case.window if inputs.config.layer_types[layer] == "sliding" else None
    q = inputs.views(layer)[0]
    out, start = [], 0
    for r, k, v in zip(inputs.reqs, inputs.keys[layer], inputs.values[layer]):
        out.append(reference.attention(q[start: start + r.extend_len], k, v, r.cached_len, window,
                                       inputs.config.attn_scale))
        start += r.extend_len
    return torch.cat(out)


def _pair(case: AttentionCase, device: torch.device | str, kernel: Kernel, fault: Fault | None):
    if case.phase == "graph" and kernel != "flashinfer":
        raise ValueError("the graph phase captures FlashInfer's decode in a CUDA graph: it needs kernel='flashinfer'"
                         " on a CUDA device")
    inputs = build(case, device)
    return inputs, _run(kernel, inputs, fault), _run("torch", inputs, None)


def check_attention(case: AttentionCase, device: torch.device | str = "cuda", kernel: Kernel = "flashinfer",
                    fault: Fault | None = None) -> CheckResult:
    """The kernel's attention output per layer against the torch backend's, both against the exact result."""
    check_fault(fault, ("softmax_scale", "kv_slot"), "attention")
    inputs, (got, _), (ref, _) = _pair(case, device, kernel, fault)
    result = CheckResult("attention", case.name, fault)
    for layer, (g, r) in enumerate(zip(got, ref)):
        kind = inputs.config.layer_types[layer]
        name = f"layer {layer} ({kind if kind == 'full' else f'window {case.window}'})"
        result.errors[name] = measure(g, r, _exact(inputs, layer))
    return result


def check_kv_append(case: AttentionCase, device: torch.device | str = "cuda", kernel: Kernel = "flashinfer",
                    fault: Fault | None = None) -> CheckResult:
    """The kernel's pool after the step against the torch write, bitwise, on every page but the dummy page (where
    the padding rows of the graph phase all write one slot, in no defined order): so the padding rows wrote only
    there, and every real token landed at its slot and nowhere else."""
    check_fault(fault, ("kv_slot",), "kv_append")
    inputs, (_, got), (_, ref) = _pair(case, device, kernel, fault)
    result = CheckResult("kv_append", case.name, fault)
    n = inputs.num_pages
    for layer in range(inputs.config.num_layers):
        pairs = (("K", got.k_cache(layer), ref.k_cache(layer)), ("V", got.v_cache(layer), ref.v_cache(layer)))
        for name, a, b in pairs:
            differ = (a[:n].view(torch.int16) != b[:n].view(torch.int16)).sum()
            result.mismatches[f"layer {layer} {name}"] = int(differ)
    return result
