"""Memory planning: how many KV pages fit, and how much the forward passes need beside them."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, List

import torch

from engine.core import Batch, Req, SamplingParams, get_global_ctx
from engine.sample import Sampler
from engine.utils.misc import align_up, gib

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend
    from engine.config import EngineConfig
    from engine.kvcache import KVCachePool
    from engine.moe.base import MoEBackend

logger = logging.getLogger(__name__)


@dataclass
class MemoryPlan:
    init_free: int  # free before the model was loaded
    model: int  # what loading the model took
    reserve: int  # measured peak of activations, workspaces, graphs and logits
    bytes_per_page: int
    num_pages: int
    capped_by: str  # what bound the pool: "memory_ratio", "cpu_kv_cache_bytes" or "num_page_override"

    def describe(self, page_size: int) -> str:
        return (f"KV cache: {self.num_pages} pages x {page_size} = {self.num_pages * page_size} tokens, "
                f"{gib(self.num_pages * self.bytes_per_page)} (free before load {gib(self.init_free)}, "
                f"model {gib(self.model)}, activation reserve {gib(self.reserve)}, bound by {self.capped_by})")


def plan_num_pages(init_free_memory: int, free_memory_now: int, bytes_per_page: int, memory_ratio: float,
                   cpu_cap: int | None, reserve: int, num_page_override: int | None) -> MemoryPlan:
    """usable = memory_ratio x free-before-load - what the model took - the measured reserve (capped on a CPU)."""
    model = max(init_free_memory - free_memory_now, 0)
    if num_page_override is not None:
        num_pages, bound = num_page_override, "num_page_override"
    else:
        available = int(memory_ratio * init_free_memory) - model - reserve
        bound = "memory_ratio"
        if cpu_cap is not None and cpu_cap < available:
            available, bound = cpu_cap, "cpu_kv_cache_bytes"
        num_pages = max(available, 0) // bytes_per_page
    if num_pages <= 1:
        raise ValueError(
            f"not enough memory for the KV cache: {num_pages} page(s) of {bytes_per_page} bytes "
            f"(free before load {gib(init_free_memory)}, model {gib(model)}, reserve {gib(reserve)}); "
            "raise memory_ratio or num_page_override, or use a smaller model, dtype or max_running_req")
    return MemoryPlan(init_free_memory, model, reserve, bytes_per_page, num_pages, bound)


ALLOCATOR_SEGMENT = 2 << 20  # torch's caching allocator rounds large blocks and small segments to 2 MiB
# FlashInfer allocates this much device int workspace in every wrapper's constructor (and as much pinned host memory)
FLASHINFER_INT_WORKSPACE = 8 << 20


@dataclass
class Reserve:
    """What the forwards need beside the weights and the KV pool, by part (bytes)."""

    activations: int  # the largest eager peak: the largest prefill, the largest decode batch, the sampler's worst
    graphs: int  # what the CUDA graphs keep: their pool, their outputs, their wrappers' buffers
    workspace: int  # the attention backend's float workspace and its eager wrappers' int workspaces

    @property
    def total(self) -> int:
        return self.activations + self.graphs + self.workspace


@contextmanager
def scratch_context(config: "EngineConfig", make_kv_pool: Callable[[int], "KVCachePool"],
                    make_attn_backend: Callable[[], "AttentionBackend"],
                    make_moe_backend: Callable[[], "MoEBackend | None"]) -> Iterator[int]:
    """The global Context the probes run in, before the real pool exists: a scratch KV pool just large enough for
    the deepest prefill chunk (max_forward_len tokens ending at max_seq_len) beside the largest decode batch
    (make_kv_pool(pages)), a page table, the attention backend over it and (MoE models) the MoE backend; what the
    Context held before comes back on exit. Yields the largest decode batch."""
    ctx, device = get_global_ctx(), torch.device(config.device)
    saved = ctx.kv_cache, ctx.page_table, ctx.attn_backend, ctx.moe_backend
    tokens, max_bs = config.max_seq_len, max(config.cuda_graph_bs or [1])
    ctx.kv_cache = make_kv_pool(-(-tokens // config.page_size) + max_bs + 1)
    ctx.page_table = torch.arange(align_up(tokens, 32), dtype=torch.int32, device=device).repeat(max_bs + 1, 1)
    ctx.attn_backend = make_attn_backend()
    ctx.moe_backend = make_moe_backend()
    try:
        yield max_bs
    finally:
        ctx.kv_cache, ctx.page_table, ctx.attn_backend, ctx.moe_backend = saved


def probe_forward(model: torch.nn.Module, config: "EngineConfig", phase: str, lengths: List[int],
                  prefix: int = 0) -> None:
    """One eager forward of requests of these extend lengths (rows 0, 1, ... of the scratch page table), a prefill's
    over a cached prefix of prefix tokens. The tokens are identical, so on a MoE model each chosen expert gets all of
    them: the per-expert buffers at their largest."""
    ctx, device = get_global_ctx(), torch.device(config.device)
    cached = prefix if phase == "prefill" else 1
    reqs = [Req(torch.zeros(n + cached, dtype=torch.int32), i, cached, 1, i, SamplingParams(), None)
            for i, n in enumerate(lengths)]
    batch = Batch(reqs=reqs, phase=phase)  # type: ignore[arg-type]
    batch.padded_reqs = reqs
    n = sum(lengths)
    batch.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
    batch.positions = torch.zeros(n, dtype=torch.int32, device=device)
    batch.out_loc = torch.arange(n, dtype=torch.int64, device=device)
    ctx.attn_backend.prepare_metadata(batch)  # type: ignore[union-attr]
    with ctx.forward_batch(batch):
        model.forward()


def run_model_probes(model: torch.nn.Module, config: "EngineConfig", max_bs: int) -> None:
    """The largest forwards the engine runs eagerly, in a scratch_context: a prefill of max_forward_len tokens at the
    end of a max_seq_len sequence (on a MoE model every one of them routed to its top-k experts: the largest grouped
    GEMMs and routing buffers) and a decode of max_bs requests."""
    probe_forward(model, config, "prefill", [config.max_forward_len], deepest_prefix(config))
    probe_forward(model, config, "decode", [1] * max_bs)


def deepest_prefix(config: "EngineConfig") -> int:
    """The cached prefix of the deepest prefill chunk: a prompt longer than max_forward_len is prefilled in chunks
    of at most that many tokens, the last ending at max_seq_len, and attention's buffers may grow with the keys a
    chunk attends over (the torch backend's scores do), so the reserve is measured there."""
    return config.max_seq_len - config.max_forward_len


def cublas_workspace_bytes(device: torch.device) -> int:
    """torch's cuBLAS workspace, which the graphs' capture stream gets a copy of (one per stream that runs a GEMM):
    CUBLAS_WORKSPACE_CONFIG=:SIZE_KiB:COUNT[:SIZE_KiB:COUNT...] when set, else torch's default, 32 MiB on sm90 and
    2 x 4 MiB + 8 x 16 KiB on other GPUs (measured on the H200: the captures took 29.8 MiB more than the rest)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    numbers = [int(x) for x in config.split(":") if x.isdigit()]
    if numbers and len(numbers) % 2 == 0:
        return sum(size * count for size, count in zip(numbers[::2], numbers[1::2])) * 1024
    major, minor = torch.cuda.get_device_capability(device)
    return 4096 * 8 * 1024 if (major, minor) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


@torch.inference_mode()
def measure_reserve(model: torch.nn.Module, config: "EngineConfig", make_kv_pool: Callable[[int], "KVCachePool"],
                    make_attn_backend: Callable[[], "AttentionBackend"],
                    make_moe_backend: Callable[[], "MoEBackend | None"]) -> Reserve:
    """Measured on CUDA before the KV pool exists, in a scratch_context.

    Eager forwards run beside the graphs, so the two add up. activations: the peak of the largest prefill
    (max_forward_len tokens, at the deepest prefix a chunk has: the reserve follows the prefill budget, not
    max_seq_len), of the largest decode batch and of the sampler's worst path over max_running_req rows.
    graphs: the captures share one private pool, which grows to the peak of the largest captured forward (measured:
    a decode of the largest graph batch, a prefill of the largest graph bucket), plus the outputs every graph keeps
    (decode logits, prefill hidden states of each bucket and kind; counted from their shapes, each rounded to the
    allocator's 2 MiB), the graph wrappers' int workspaces, the static inputs and page lists the graphs read (from
    their shapes), and the capture stream's cuBLAS workspace. workspace: FlashInfer's float workspace and the int
    workspaces of its eager wrappers (prefill, decode, ragged prefill: one each a window).
    Peaks are the allocator's reserved segments, as a graph's pool holds them. GraphRunner.memory_used is what the
    captures really took, to check this against.
    """
    from engine.attention.base import layer_windows
    from engine.graph import token_buckets

    mc, device = config.model_config, torch.device(config.device)
    tokens = config.max_forward_len
    graph_bs = config.cuda_graph_bs or []
    buckets = token_buckets(config.prefill_graph_tokens or 0)

    def peak(run: Callable[[], object]) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(device)  # the scratch pool and the backend's workspace left out
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_reserved(device) - base

    try:
        with scratch_context(config, make_kv_pool, make_attn_backend, make_moe_backend) as max_bs:
            # a backend with a ragged prefill has a second prefill graph a bucket, its own graph wrappers and an
            # eager one a window
            kinds = 1 + get_global_ctx().attn_backend.ragged_prefill  # type: ignore[union-attr]
            # the eager prefill at the deepest prefix a chunk has; a graph's pool is sized by its capture's, at none
            prefill = {n: peak(lambda n=n: probe_forward(model, config, "prefill", [n],
                                                         deepest_prefix(config) if n == tokens else 0))
                       for n in {tokens, *buckets[-1:]}}
            decode = peak(lambda: probe_forward(model, config, "decode", [1] * max_bs))
            rows = config.max_running_req
            worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)  # min_p forces the sort path
            batch = Batch(reqs=[Req(torch.zeros(1, dtype=torch.int32), 0, 0, 1, 0, worst, None)] * rows,
                          phase="decode")
            sampler = Sampler(device, mc.vocab_size)
            sampling = peak(lambda: sampler.sample(torch.randn(rows, mc.vocab_size, device=device),
                                                   sampler.prepare(batch)))
    finally:
        torch.cuda.empty_cache()
    from engine.attention.flashinfer_backend import WORKSPACE_BYTES

    item, tp = next(model.parameters()).dtype.itemsize, config.tp_info.size
    per_window = len(set(layer_windows(mc))) * FLASHINFER_INT_WORKSPACE  # one wrapper of a kind: one a window
    graphs = 0
    if graph_bs or buckets:
        pool = max(decode if graph_bs else 0, prefill[buckets[-1]] if buckets else 0)
        # each kept output holds its own allocator block, rounded up to the allocator's 2 MiB segment granularity
        kept = [bs * -(-mc.vocab_size // tp) * tp * item for bs in graph_bs] + [t * mc.hidden_size * item
                                                                                for t in buckets] * kinds
        outputs = sum(align_up(b, ALLOCATOR_SEGMENT) for b in kept)
        wrappers = (len(graph_bs) + bool(buckets) * kinds) * per_window
        width = -(-align_up(config.max_seq_len, 32) // config.page_size)  # pages of a page-table row, at most
        t = max(buckets, default=0)
        static = 16 * max(max_bs, t)  # the runner's ids, positions (int32) and slots (int64)
        if graph_bs:  # decode page indices (int32)
            static += 4 * max_bs * width
        if buckets:  # prefill page indices and each token's entry (int32)
            static += 4 * (config.prefill_graph_max_reqs * width + t // config.page_size + 1 + t)
        graphs = pool + outputs + wrappers + static + cublas_workspace_bytes(device)
    flashinfer = config.attention_backend == "flashinfer"
    reserve = Reserve(activations=max(prefill[tokens], decode, sampling), graphs=graphs,
                      workspace=WORKSPACE_BYTES + (1 + kinds) * per_window if flashinfer else 0)
    logger.info("reserve %s: activations %s (prefill of %d tokens after %d cached, decode of %d, sampling %d rows), "
                "graphs %s (%d decode sizes, prefill buckets %s), workspace %s", gib(reserve.total),
                gib(reserve.activations), tokens, deepest_prefix(config), max_bs, rows, gib(reserve.graphs), len(graph_bs), buckets, gib(reserve.workspace))
    return reserve
