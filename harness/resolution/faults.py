"""Planted faults of a known size e, in-process: each family is a context manager that changes what the engine or
the sampler computes while it is entered, and restores it bitwise on exit (e = 0 changes nothing either).

Most families act on objects a built engine reads at every call (the attention backends' scale, the rotary tables
rewritten in place, the KV store, the sampler's arguments), so one engine serves every probe. CUDA graphs bake
kernel arguments and captured ops at capture: on FlashInfer a softmax-scale error in decode attention (decode
graphs) or in prefill attention (prefill graphs), and the KV wrong-slot fault (either), are captured only by an
engine built inside the context (`baked`).
Class attributes are patched, so the patch reaches the one live engine and any engine built inside.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Literal, Tuple

import torch

from engine import Engine
from engine.attention.cpu_backend import CpuBackend
from engine.attention.flashinfer_backend import FlashInferBackend
from engine.attention.torch_backend import TorchBackend
from engine.core import get_global_ctx
from engine.kernels import qk_rope_store
from engine.kvcache import KVCachePool
from engine.layers.rotary import RotaryEmbedding, cos_sin_table
from engine.sample import BatchSamplingArgs, Sampler

Target = Literal["engine", "sampler"]
Patch = Tuple[object, str, Callable[[Callable], Callable]]  # (owner, attribute, original -> replacement)
Plant = Callable[[float, "Engine | None"], ContextManager[Any]]  # (e, the live engine or None) -> the fault


@dataclass(frozen=True)
class Family:
    name: str
    what: str  # what a fault of size e is
    target: Target  # engine families apply to parity, sampler families to the sampling grid
    plant: Plant
    baked: Callable[[Engine], bool]  # True: on this engine the fault takes effect only if built inside `plant`
    e_min: float  # the search range
    e_max: float
    e_min_half: float | None = None  # where a half-precision check starts (its error floor is ~100 x fp32's)


@contextmanager
def patched(patches: List[Patch]) -> Iterator[None]:
    """Replace each owner.attribute by wrap(original) while entered; on exit the owner is as it was (an attribute
    it inherited is inherited again)."""
    saved = [(owner, name, vars(owner).get(name, _INHERITED)) for owner, name, _ in patches]
    try:
        for owner, name, wrap in patches:
            setattr(owner, name, wrap(getattr(owner, name)))
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


_INHERITED = object()


def _never(engine: Engine) -> bool:
    return False


def _decode_graphed(engine: Engine) -> bool:
    return engine.config.attention_backend == "flashinfer" and bool(engine.graph_runner.graphs)


def _prefill_graphed(engine: Engine) -> bool:
    return engine.config.attention_backend == "flashinfer" and bool(engine.graph_runner.prefill_graphs)


def _graphed_flashinfer(engine: Engine) -> bool:
    return _decode_graphed(engine) or _prefill_graphed(engine)


# ---------------------------------------------------------------------------------------------- softmax scale
def _softmax_scale(phase: str) -> Plant:
    """The attention logits' scale x (1 + e) in one phase's attention only, on every backend. FlashInfer takes the
    scale when a batch is planned (and a decode graph when it is captured), the torch and cpu backends at each call."""

    @contextmanager
    def plant(e: float, engine: Engine | None = None) -> Iterator[None]:
        factor = 1.0 + e

        def torch_forward(original: Callable) -> Callable:
            def forward(self: TorchBackend | CpuBackend, q: torch.Tensor, kv: torch.Tensor, layer_id: int,
                        batch) -> torch.Tensor:
                if batch.phase != phase:
                    return original(self, q, kv, layer_id, batch)
                saved = self.scale  # None: SDPA's 1 / sqrt(head_dim), computed as SDPA does
                self.scale = (saved if saved is not None else 1.0 / math.sqrt(q.shape[-1])) * factor
                try:
                    return original(self, q, kv, layer_id, batch)
                finally:
                    self.scale = saved
            return forward

        def flashinfer_plan(original: Callable) -> Callable:
            def plan(self: FlashInferBackend, batch) -> None:
                if batch.phase != phase:
                    return original(self, batch)
                saved = self.sm_scale
                self.sm_scale = saved * factor
                try:
                    return original(self, batch)
                finally:
                    self.sm_scale = saved
            return plan

        patches: List[Patch] = [(TorchBackend, "forward", torch_forward), (CpuBackend, "forward", torch_forward),
                                (FlashInferBackend, "prepare_metadata", flashinfer_plan)]
        if phase == "decode":
            patches.append((FlashInferBackend, "prepare_for_capture", flashinfer_plan))
        with patched(patches):
            yield

    return plant


# ---------------------------------------------------------------------------------------------- RoPE base
@contextmanager
def _rope_base(e: float, engine: Engine | None) -> Iterator[None]:
    """Every rotary table rebuilt from base x (1 + e) and written into the live table in place (a captured graph
    reads the same storage); the original values come back on exit."""
    if engine is None:
        raise ValueError("the rope-base fault rewrites a built engine's rotary tables: pass the engine")
    modules = [m for m in engine.model.modules() if isinstance(m, RotaryEmbedding)]
    saved = [m.table.clone() for m in modules]
    try:
        for m in modules:
            table = cos_sin_table(replace(m.cfg, base=m.cfg.base * (1.0 + e)), m.table.shape[0])
            m.table.copy_(m.ops.rope_table(table, engine.dtype))
        yield
    finally:
        for m, table in zip(modules, saved):
            m.table.copy_(table)


# ---------------------------------------------------------------------------------------------- KV wrong slot
_WEYL_SLOT, _WEYL_LAYER = (math.sqrt(5) - 1) / 2, math.sqrt(2) - 1


def lost_writes(slots: torch.Tensor, layer_id: int, e: float) -> torch.Tensor:
    """[N] bool: the writes the fault sends astray, a deterministic fraction e of (slot, layer) pairs. A Weyl
    sequence in the slot spreads them evenly over a request's positions, and the set at e is inside the set at any
    larger e (the fault grows monotonically)."""
    u = torch.frac((slots.double() + 1.0) * _WEYL_SLOT + (layer_id + 1) * _WEYL_LAYER)
    return u < e


def _dummy_slot(pool: KVCachePool) -> int:
    return (pool.num_pages - 1) * pool.page_size  # the last page is the dummy request's: no request reads it


@dataclass
class LostWrites:
    """What a KV wrong-slot fault did: the writes it sent astray, counted outside CUDA graphs (a replay's are not)."""

    counted: int = 0
    in_graphs: bool = False  # some were captured into a decode graph, and its replays are not counted

    def add(self, lost: torch.Tensor) -> None:
        if lost.is_cuda and torch.cuda.is_current_stream_capturing():
            self.in_graphs = True
        else:
            self.counted += int(lost.sum())

    def __str__(self) -> str:
        return f"{self.counted} KV writes lost" + (" outside graph replays" if self.in_graphs else "")


@contextmanager
def _kv_wrong_slot(e: float, engine: Engine | None = None) -> Iterator[LostWrites]:
    """A fraction e of the KV writes land in the dummy page instead of their slot, which keeps what it held (zeros
    in a fresh pool, an earlier request's KV in a reused page). Yields the count of writes lost."""
    tally = LostWrites()

    def store_kv(original: Callable) -> Callable:
        def store(self: KVCachePool, kv: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
            lost = lost_writes(out_loc, layer_id, e)
            tally.add(lost)
            return original(self, kv, torch.where(lost, _dummy_slot(self), out_loc), layer_id)
        return store

    def fused_store(original: Callable) -> Callable:
        def store(positions, q, kv, table, q_weight, k_weight, eps, k_pool, v_pool, out_loc) -> None:
            # fixed shapes only (a decode graph captures this): the lost slots get their old content back
            lost = lost_writes(out_loc, _layer_of(k_pool), e)
            tally.add(lost)
            before = [p[out_loc].clone() for p in (k_pool, v_pool)]
            original(positions, q, kv, table, q_weight, k_weight, eps, k_pool, v_pool, out_loc)
            for p, old in zip((k_pool, v_pool), before):
                p[out_loc] = torch.where(lost[:, None, None], old, p[out_loc])
        return store

    with patched([(KVCachePool, "store_kv", store_kv), (qk_rope_store, "qk_rope_store", fused_store)]):
        yield tally


def _layer_of(k_pool: torch.Tensor) -> int:
    """The layer whose K slots k_pool [slots, Hkv, D] is: the pool holds every layer's K, then V, in one allocation."""
    pool = get_global_ctx().kv_cache
    layer = k_pool.storage_offset() // k_pool.numel()
    assert pool.k_cache(layer).data_ptr() == k_pool.data_ptr(), "not a K view of the live pool"
    return layer


# ---------------------------------------------------------------------------------------------- the sampler
def _sampler_args(change: Callable[[BatchSamplingArgs, float], None]) -> Plant:
    @contextmanager
    def plant(e: float, engine: Engine | None = None) -> Iterator[None]:
        def prepare(original: Callable) -> Callable:
            def wrapped(self: Sampler, batch):
                args = original(self, batch)
                change(args, e)
                return args
            return wrapped

        with patched([(Sampler, "prepare", prepare)]):
            yield
    return plant


def _hotter(args: BatchSamplingArgs, e: float) -> None:
    if args.temperatures is not None:  # greedy rows stay the argmax whatever their temperature
        args.temperatures = args.temperatures * (1.0 + e)


def _wider_top_p(args: BatchSamplingArgs, e: float) -> None:
    if args.top_p is not None:  # rows at top_p 1 stay at 1
        args.top_p = (args.top_p + e).clamp(max=1.0)


@contextmanager
def _sampler_softmax_scale(e: float, engine: Engine | None = None) -> Iterator[None]:
    """The sampler's softmax on logits x (1 + e): the same distribution as temperature / (1 + e)."""
    def sample(original: Callable) -> Callable:
        def wrapped(self: Sampler, logits: torch.Tensor, args) -> torch.Tensor:
            return original(self, logits * (1.0 + e), args)
        return wrapped

    with patched([(Sampler, "sample", sample)]):
        yield


FAMILIES: Dict[str, Family] = {f.name: f for f in [
    Family("softmax-decode", "decode attention's softmax scale x (1 + e)", "engine", _softmax_scale("decode"),
           _decode_graphed, 1e-6, 1.0, 1e-4),
    Family("softmax-prefill", "prefill (and extend) attention's softmax scale x (1 + e)", "engine",
           _softmax_scale("prefill"), _prefill_graphed, 1e-6, 1.0, 1e-4),
    # below about 1e-7 the base rounds to the same float32 value (the tables are computed in fp32): no change
    Family("rope-base", "RoPE base x (1 + e) in every rotary table", "engine", _rope_base, _never, 1e-8, 1.0, 1e-5),
    # a single lost write may be visible in any precision: the search starts below one write in the golden's run
    Family("kv-wrong-slot", "a fraction e of KV writes (slot, layer) sent to the dummy page", "engine",
           _kv_wrong_slot, _graphed_flashinfer, 1e-6, 1.0, 1e-6),
    Family("sampler-softmax", "the sampler's softmax on logits x (1 + e) (temperature / (1 + e))", "sampler",
           _sampler_softmax_scale, _never, 1e-3, 1.0),
    Family("temperature", "every sampled row's temperature x (1 + e)", "sampler", _sampler_args(_hotter), _never,
           1e-3, 1.0),
    Family("top-p", "every top-p row's top_p + e (at most 1)", "sampler", _sampler_args(_wider_top_p), _never,
           1e-3, 0.5),
]}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown fault family {name!r}; choose from: {', '.join(FAMILIES)}")
    return FAMILIES[name]

