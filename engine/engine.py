"""Engine: the compute engine of one TP rank. Built in a fixed order; one method, forward_batch."""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass
from typing import Any, List

import torch

from engine import batch_invariant
from engine.attention import create_attention_backend, resolve_attention_backend
from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.core import Batch, Context, Req, has_global_ctx, set_global_ctx
from engine.distributed import (destroy_process_groups, div_even, init_process_groups, set_tp_info,
                                tp_broadcast, tp_min_over_ranks)
from engine.graph import GraphRunner, token_buckets
from engine.kvcache import KVCachePool, create_kvcache_pool
from engine.layers.ops import create_ops, resolve_ops_backend
from engine.memory import MemoryPlan, Reserve, measure_reserve, plan_num_pages
from engine.models import create_model, dummy_state_dict, load_weight_state_dict
from engine.models.decoder import heads_per_rank
from engine.moe import MoEBackend, create_moe_backend, resolve_moe_backend
from engine.sample import BatchSamplingArgs, Sampler
from engine.utils.device import create_event, create_stream, free_memory, is_cuda, physical_cores, set_stream
from engine.utils.hf import check_model_dir
from engine.utils.misc import align_up, gib
from engine.utils.threads import check_mkl_cnr, fix_cpu_threads

logger = logging.getLogger(__name__)


@dataclass
class ForwardOutput:
    next_tokens_gpu: torch.Tensor  # [bs] int32 on the engine's device: the next step's input, never leaves it
    next_tokens_cpu: torch.Tensor  # [bs] int32 on the host, valid after copy_done_event.synchronize()
    copy_done_event: Any
    logits: torch.Tensor | None = None  # float32 [bs or num_tokens, vocab] when the batch asked for them
    # float32 [the logits' rows, MoE layers]: each row's router margin per MoE layer (record_router_margins)
    router_margins: torch.Tensor | None = None


class Engine:
    def __init__(self, config: EngineConfig):
        try:
            self._init(config)
        except BaseException:
            self.shutdown()  # a failed start leaves nothing behind: the next Engine can start
            raise

    def _init(self, config: EngineConfig) -> None:
        # refused before anything process-wide changes: a live engine's context, stream, TP state stay its own
        if has_global_ctx():
            raise RuntimeError("an Engine is already live in this process: call its shutdown() first")
        self._owns_process_state = True  # from here on, shutdown() resets the process-wide state
        set_tp_info(rank=config.tp_info.rank, size=config.tp_info.size)
        self.config = config = _adjust_config(config)
        self.device = torch.device(config.device)
        if is_cuda(self.device):
            torch.cuda.set_device(self.device)
        else:
            fix_cpu_threads(max(1, physical_cores() // config.tp_info.size))  # not free to follow the load
            check_mkl_cnr()  # nor to take another kernel in another process
        torch.manual_seed(config.seed)
        self.stream = create_stream(self.device)
        set_stream(self.stream)
        self.dtype = config.dtype
        self.ctx = Context(config.page_size)
        set_global_ctx(self.ctx)

        self.tp_cpu_group = self._init_communication(config)
        init_free_memory = self._sync_get_memory()
        logger.info("free memory before loading the model: %s", gib(init_free_memory))

        # the model: an empty shell on the meta device, then the weights swapped in
        self.model = self._load_model(config)

        # the KV pool gets the memory left; the extra page belongs to the dummy request
        self.num_qo_heads, self.num_kv_heads = heads_per_rank(config.model_config)
        self.reserve: Reserve | None = None  # the measured reserve by part, on CUDA
        self.plan = self._determine_num_pages(init_free_memory, config)
        self.num_pages = self.plan.num_pages
        num_tokens = self.num_pages * config.page_size
        self.ctx.kv_cache = self.kv_cache = self._make_kv_pool(config, self.num_pages + 1)

        # the page table: one row per request slot holding each position's KV slot; the last row is the dummy's
        self.max_seq_len = min(config.max_seq_len, num_tokens)
        aligned_max_seq_len = align_up(self.max_seq_len, 32)
        self.ctx.page_table = self.page_table = torch.zeros(
            (config.max_running_req + 1, aligned_max_seq_len), dtype=torch.int32, device=self.device)

        # the attention backend (reads the pool, so it comes after it), the MoE backend and the sampler
        self.ctx.attn_backend = self.attn_backend = self._make_attn_backend(config)
        self.moe_backend = None
        if config.model_config.is_moe:
            self.ctx.moe_backend = self.moe_backend = self._make_moe_backend(config)
            if config.record_router_margins:
                rows = max(config.max_forward_len, config.max_running_req)
                self.ctx.router_margins = torch.zeros(rows, sum(config.model_config.moe_layers), device=self.device)
        self.sampler = Sampler(self.device, config.model_config.vocab_size, seed=config.seed)

        # the dummy request and CUDA graphs (capturing runs the model, so it comes last)
        self.dummy_req = Req(input_ids=torch.tensor([0], dtype=torch.int32), table_idx=config.max_running_req,
                             cached_len=0, output_len=1, uid=-1, sampling_params=None,  # type: ignore[arg-type]
                             cache_handle=None)
        self.page_table[self.dummy_req.table_idx].fill_(num_tokens)  # every position -> the dummy page
        self.graph_runner = GraphRunner(self.stream, self.device, self.model, self.attn_backend,
                                        config.cuda_graph_bs or [], self.dummy_req,
                                        # the padding entry's tokens sit at positions 0, 1, ... of a page-table row
                                        token_buckets(min(config.prefill_graph_tokens or 0, aligned_max_seq_len)),
                                        config.prefill_graph_max_reqs)

    # ------------------------------------------------------------------ init steps
    def _init_communication(self, config: EngineConfig) -> Any:
        if config.tp_info.size == 1:
            return None
        return init_process_groups(config.tp_info, self.device, config.distributed_addr, config.distributed_timeout)

    def _sync_get_memory(self) -> int:
        """Free memory now, the minimum across TP ranks."""
        return tp_min_over_ranks(free_memory(self.device))

    def _load_model(self, config: EngineConfig) -> torch.nn.Module:
        with torch.device("meta"):
            model = create_model(config.model_config, config.max_seq_len, self.device, self.dtype,
                                 create_ops(config.ops_backend, config.batch_invariant))
        if config.use_dummy_weight:
            state = dummy_state_dict(model, self.device, self.dtype)
        else:
            state = load_weight_state_dict(str(check_model_dir(config.model_path)), config.model_config,
                                           self.device, self.dtype)
        model.load_state_dict(state, strict=True, assign=True)
        model.pack_weights()
        if config.batch_invariant:  # the BLAS here must have the property the mode's GEMM rests on
            batch_invariant.check_gemm(next(p for n, p in model.named_parameters()
                                            if p.dim() == 2 and "embed" not in n))
        return model.eval()

    def _determine_num_pages(self, init_free_memory: int, config: EngineConfig) -> MemoryPlan:
        mc = config.model_config
        bytes_per_page = 2 * mc.head_dim * self.num_kv_heads * config.page_size * self.dtype.itemsize * mc.num_layers
        plan = plan_num_pages(
            init_free_memory=init_free_memory,
            free_memory_now=self._sync_get_memory(),
            bytes_per_page=bytes_per_page,
            memory_ratio=config.memory_ratio,
            cpu_cap=None if is_cuda(self.device) else config.cpu_kv_cache_bytes,
            reserve=self._activation_reserve(config),
            num_page_override=config.num_page_override,
        )
        logger.info("%s", plan.describe(config.page_size))
        return plan

    def _activation_reserve(self, config: EngineConfig) -> int:
        """Bytes the forward passes need beyond the weights and the KV pool (measured on CUDA, 0 on a CPU); the
        parts stay in self.reserve."""
        if not is_cuda(self.device):
            return 0
        self.reserve = measure_reserve(self.model, config, lambda pages: self._make_kv_pool(config, pages),
                                       lambda: self._make_attn_backend(config), lambda: self._make_moe_backend(config))
        return self.reserve.total

    def _make_kv_pool(self, config: EngineConfig, num_pages: int) -> KVCachePool:
        return create_kvcache_pool(config.model_config, num_pages, config.page_size, self.num_kv_heads, self.device,
                                   self.dtype)

    def _make_attn_backend(self, config: EngineConfig) -> AttentionBackend:
        return create_attention_backend(config.attention_backend, config.model_config, self.num_qo_heads,
                                        self.num_kv_heads, self.device, self.dtype, config.batch_invariant)

    def _make_moe_backend(self, config: EngineConfig) -> MoEBackend | None:
        return create_moe_backend(config.moe_backend, self.device, config.batch_invariant) \
            if config.model_config.is_moe else None

    # ------------------------------------------------------------------ the one method
    @torch.inference_mode()
    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        if batch.is_prefill:
            self._check_prefill(batch)
        with self.ctx.forward_batch(batch):
            if self.graph_runner.can_use_cuda_graph(batch):
                logits = self.graph_runner.replay(batch)  # its copy into the static int64 slots converts int32 ones
            else:
                if batch.out_loc.dtype != torch.int64:  # the pool's index_copy_ takes int64 slots
                    batch.out_loc = batch.out_loc.long()
                logits = self.model.forward()
        for req in batch.reqs:
            req.complete_one()
        if batch.return_logits == "all" and batch.is_prefill:
            rows = logits[batch.attn_metadata.last_indices()[: batch.size]]
        else:
            logits = rows = logits[: batch.size]
        next_tokens_gpu = tp_broadcast(self.sampler.sample(rows, args).to(torch.int32))
        next_tokens_cpu = next_tokens_gpu.to("cpu", non_blocking=True)
        copy_done_event = create_event(self.device)
        copy_done_event.record(self.stream)
        out_logits = logits.float() if batch.return_logits != "none" else None
        return ForwardOutput(next_tokens_gpu, next_tokens_cpu, copy_done_event, out_logits, self._margins(batch))

    def _margins(self, batch: Batch) -> torch.Tensor | None:
        """The router margins of the rows forward_batch returns logits for (a copy: the buffer is reused)."""
        margins = self.ctx.router_margins
        if margins is None or batch.return_logits == "none":
            return None
        if batch.is_decode:
            return margins[: batch.size].clone()
        if batch.return_logits == "all":
            return margins[: batch.input_ids.shape[0]].clone()
        return margins[batch.attn_metadata.last_indices()[: batch.size]]

    def _check_prefill(self, batch: Batch) -> None:
        """Host-side checks of what a user controls; a bad id would otherwise fail deep inside a kernel."""
        vocab = self.config.model_config.vocab_size
        tokens = sum(r.extend_len for r in batch.reqs)
        if tokens > self.config.max_forward_len:
            raise ValueError(f"prefill batch of {tokens} tokens exceeds max_forward_len {self.config.max_forward_len} "
                             "(the memory plan reserved activations for that many): split it")
        for req in batch.reqs:
            if req.device_len > self.max_seq_len:
                raise ValueError(f"request {req.uid}: {req.device_len} tokens exceed max_seq_len {self.max_seq_len}")
            ids = req.input_ids[req.cached_len: req.device_len].numpy()  # numpy: a torch op on the host costs more
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                bad = ids[(ids < 0) | (ids >= vocab)][:5].tolist()
                raise ValueError(f"request {req.uid}: token ids {bad} are outside the vocabulary [0, {vocab})")
            if not (0 <= req.table_idx < self.config.max_running_req):
                raise ValueError(f"request {req.uid}: table_idx {req.table_idx} outside [0, "
                                 f"{self.config.max_running_req})")

    def shutdown(self) -> None:
        """Release everything this engine set up (also after a failed start), so another Engine can start."""
        if getattr(self, "graph_runner", None) is not None:
            self.graph_runner.destroy()
        # the TP group too: gloo closes its sockets only when the group object is freed
        self.model = self.kv_cache = self.page_table = self.attn_backend = None  # type: ignore[assignment]
        self.graph_runner = self.tp_cpu_group = self.moe_backend = None
        if getattr(self, "ctx", None) is not None:
            self.ctx.kv_cache = self.ctx.page_table = self.ctx.attn_backend = None
            self.ctx.moe_backend = self.ctx.router_margins = None
        if getattr(self, "_owns_process_state", False):  # not an engine refused because another one is live
            self._owns_process_state = False
            set_global_ctx(None)
            set_stream(None)
            destroy_process_groups()
        gc.collect()
        device = getattr(self, "device", None)
        if device is not None and is_cuda(device):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def _adjust_config(config: EngineConfig) -> EngineConfig:
    """Resolve the "auto" choices into a new frozen config."""
    check_model_dir(config.model_path)  # dummy weights still need the config
    mc = config.model_config
    div_even(mc.num_qo_heads, config.tp_info.size)  # raises a clear error when TP does not divide the heads
    div_even(mc.num_kv_heads, config.tp_info.size, allow_replicate=True)
    if not mc.is_moe or not all(mc.moe_layers):  # some layer keeps the dense MLP
        div_even(mc.intermediate_size, config.tp_info.size)
    if mc.is_moe and mc.moe_intermediate_size % config.tp_info.size:
        raise ValueError(f"moe_intermediate_size {mc.moe_intermediate_size} (each of the {mc.num_experts} experts' "
                         f"intermediate dimension, which TP splits) is not divisible by TP size {config.tp_info.size}")
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{config.tp_info.rank}"  # one GPU per TP rank
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    if config.batch_invariant:
        config = _invariant_backends(config, device)
    backend = resolve_attention_backend(config.attention_backend, torch.device(device), config.dtype, mc)
    ops = resolve_ops_backend(config.ops_backend, torch.device(device), config.dtype)
    moe = resolve_moe_backend(config.moe_backend, torch.device(device), config.dtype, mc, config.tp_info.size)
    graph_bs: List[int] = []
    prefill_tokens = 0
    # the torch MoE reference reads its routing on the host, which a CUDA graph cannot capture: decode runs eagerly
    if device.startswith("cuda") and backend == "flashinfer" and not (mc.is_moe and moe == "torch"):
        max_bs = config.cuda_graph_max_bs if config.cuda_graph_max_bs is not None else min(config.max_running_req, 256)
        graph_bs = config.cuda_graph_bs or [b for b in [1, 2, 4] + list(range(8, max_bs + 1, 8)) if b <= max_bs]
        if any(b > config.max_running_req for b in graph_bs):
            raise ValueError(f"cuda_graph_bs {graph_bs} exceeds max_running_req {config.max_running_req}")
        prefill_tokens = _prefill_graph_tokens(config)
    return dataclasses.replace(config, device=device, attention_backend=backend, ops_backend=ops, moe_backend=moe,
                               cuda_graph_bs=graph_bs, cuda_graph_max_bs=max(graph_bs, default=0),
                               prefill_graph_tokens=prefill_tokens,
                               prefill_graph_max_reqs=min(config.prefill_graph_max_reqs, config.max_running_req))


def _invariant_backends(config: EngineConfig, device: str) -> EngineConfig:
    """batch_invariant: the torch kernels (the invariant compositions replace their GEMMs and attention), or why not."""
    if device.startswith("cuda"):
        raise ValueError("batch_invariant runs on the CPU only: on CUDA, cuBLAS and the skinny GEMM choose their "
                         "kernel by the row count and FlashInfer its KV split by the batch, and the fixed-tiling "
                         "GEMM and fixed-split attention that would replace them are not built yet")
    chosen = {"attention_backend": config.attention_backend, "ops_backend": config.ops_backend,
              "moe_backend": config.moe_backend}
    if any(v not in ("auto", "torch") for v in chosen.values()):
        raise ValueError(f"batch_invariant uses the torch kernels, got {chosen}")
    return dataclasses.replace(config, **{k: "torch" for k in chosen})


def _prefill_graph_tokens(config: EngineConfig) -> int:
    """The largest prefill graph's token count: auto follows the decode graphs' switch; an explicit bound must fit
    the forward budget the memory plan reserves for."""
    if config.prefill_graph_tokens is None:
        return 0 if config.cuda_graph_max_bs == 0 else min(4096, config.max_forward_len)
    if config.prefill_graph_tokens > config.max_forward_len:
        raise ValueError(f"prefill_graph_tokens {config.prefill_graph_tokens} exceeds max_forward_len "
                         f"{config.max_forward_len}: lower it or raise max_prefill_tokens / max_seq_len_override")
    return config.prefill_graph_tokens
