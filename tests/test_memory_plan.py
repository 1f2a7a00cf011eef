"""The KV memory plan, term by term: each input moves the page count by exactly what the rule says, and the Engine
measures and passes every term (free memory before and after loading the model, the reserve, memory_ratio, the CPU
cap, num_page_override, bytes per page from the model's config).

    usable = memory_ratio x free before load - (free before load - free after load) - reserve
    pages  = min(usable, cpu_kv_cache_bytes on a CPU) // bytes_per_page, unless num_page_override
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch

import engine.engine as engine_module
from engine import Engine, EngineConfig
from engine.distributed import DistributedInfo
from engine.memory import MemoryPlan, plan_num_pages
from harness import zoo

KB = 1000  # bytes per page in the pure tests: round numbers of pages
BASE: Dict[str, Any] = dict(init_free_memory=1_000 * KB, free_memory_now=800 * KB, bytes_per_page=KB,
                            memory_ratio=0.9, cpu_cap=None, reserve=50 * KB, num_page_override=None)
BASE_PAGES = 900 - 200 - 50  # 0.9 x 1000 free before load - 200 the model took - 50 reserve


def plan(**change: Any) -> MemoryPlan:
    return plan_num_pages(**{**BASE, **change})


# ------------------------------------------------------------------------------------------ plan_num_pages
def test_base_plan_reports_every_term() -> None:
    assert plan() == MemoryPlan(init_free=1_000 * KB, model=200 * KB, reserve=50 * KB, bytes_per_page=KB,
                                num_pages=BASE_PAGES, capped_by="memory_ratio")


def test_free_memory_before_load_counts_at_memory_ratio() -> None:
    """More free before load with the model's footprint unchanged: 0.9 of it becomes pages."""
    assert plan(init_free_memory=1_100 * KB, free_memory_now=900 * KB).num_pages == BASE_PAGES + 90


def test_free_memory_before_load_alone_also_grows_the_model() -> None:
    """Free after load fixed: 100 more before means the model took 100 more, so 0.9 x 100 - 100 pages."""
    p = plan(init_free_memory=1_100 * KB)
    assert (p.num_pages, p.model) == (BASE_PAGES - 10, 300 * KB)


def test_model_footprint_is_subtracted_in_full() -> None:
    p = plan(free_memory_now=700 * KB)
    assert (p.num_pages, p.model) == (BASE_PAGES - 100, 300 * KB)


def test_model_footprint_is_never_negative() -> None:
    """Free memory that grew while loading (other processes let go) gives no credit."""
    p = plan(free_memory_now=1_050 * KB)
    assert (p.num_pages, p.model) == (900 - 50, 0)


def test_reserve_is_subtracted_in_full() -> None:
    p = plan(reserve=80 * KB)
    assert (p.num_pages, p.reserve) == (BASE_PAGES - 30, 80 * KB)


def test_memory_ratio_scales_free_memory_before_load() -> None:
    assert plan(memory_ratio=0.5).num_pages == BASE_PAGES - 400  # 0.4 x 1000 less
    assert plan(memory_ratio=1.0).num_pages == BASE_PAGES + 100


def test_pages_are_whole_and_rounded_down() -> None:
    assert plan(bytes_per_page=3 * KB).num_pages == 650 // 3  # 216.67 pages of 3 KB -> 216
    assert plan(reserve=50 * KB + 1).num_pages == BASE_PAGES - 1  # one byte short of the last page


def test_cpu_cap_binds_when_below_usable_memory() -> None:
    p = plan(cpu_cap=300 * KB)
    assert (p.num_pages, p.capped_by) == (300, "cpu_kv_cache_bytes")


def test_cpu_cap_is_a_ceiling_on_usable_memory_not_a_budget_for_model_and_reserve() -> None:
    """Under a binding cap the model and the reserve no longer move the page count."""
    assert plan(cpu_cap=300 * KB, reserve=150 * KB, free_memory_now=750 * KB).num_pages == 300


def test_cpu_cap_above_usable_memory_changes_nothing() -> None:
    p = plan(cpu_cap=700 * KB)
    assert (p.num_pages, p.capped_by) == (BASE_PAGES, "memory_ratio")


def test_override_wins_outright() -> None:
    """Even where memory would give too few pages and where the cap would bind; the other terms are still reported."""
    for change in ({}, {"cpu_cap": 3 * KB}, {"reserve": 10_000 * KB}, {"memory_ratio": 0.01}):
        p = plan(num_page_override=1234, **change)
        assert (p.num_pages, p.capped_by) == (1234, "num_page_override"), change
    assert plan(num_page_override=1234).model == 200 * KB


@pytest.mark.parametrize("change", [{"reserve": 699 * KB}, {"reserve": 698 * KB + 1}, {"cpu_cap": 2 * KB - 1},
                                    {"reserve": 5_000 * KB}, {"num_page_override": 1}, {"num_page_override": 0}])
def test_fewer_than_two_pages_is_a_clear_error(change: Dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"not enough memory for the KV cache: -?\d+ page\(s\) of 1000 bytes .*"
                                         r"free before load .* model .* reserve .*raise memory_ratio or "
                                         r"num_page_override"):
        plan(**change)


def test_two_pages_are_enough() -> None:
    assert plan(reserve=698 * KB).num_pages == 2
    assert plan(num_page_override=2).num_pages == 2


# ------------------------------------------------------------------------------------------ through the Engine
MODEL = "tiny-qwen3"
BEFORE, AFTER = 40_000_000, 37_000_000  # scripted free memory before and after loading: the model "takes" 3 MB


def hand_bytes_per_page(page_size: int, itemsize: int, kv_heads: int | None = None) -> int:
    """2 (K and V) x head_dim x KV heads x page_size x dtype bytes x layers, read from config.json itself."""
    cfg = json.loads((zoo.path(MODEL) / "config.json").read_text())
    kv_heads = cfg["num_key_value_heads"] if kv_heads is None else kv_heads
    return 2 * cfg["head_dim"] * kv_heads * page_size * itemsize * cfg["num_hidden_layers"]


def expected_pages(bytes_per_page: int, ratio: float = 0.5) -> int:
    return (int(ratio * BEFORE) - (BEFORE - AFTER)) // bytes_per_page


def bare_engine(device: str = "cpu", num_kv_heads: int = 2) -> Engine:
    """An Engine holding only what _determine_num_pages and _sync_get_memory read: to call them on their own."""
    eng = Engine.__new__(Engine)
    eng.device, eng.dtype, eng.num_kv_heads = torch.device(device), torch.float32, num_kv_heads
    return eng


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[List[str]]:
    """Scripted free memory (BEFORE, then AFTER) where the Engine looks it up, and the order of what the Engine did:
    "free" for each measurement, "load" when it loaded the model."""
    log: List[str] = []
    script = [BEFORE, AFTER]

    def fake_free(device: torch.device) -> int:
        log.append("free")
        assert script, f"free memory measured more than twice: {log}"
        return script.pop(0)

    load = Engine._load_model

    def logged_load(self: Engine, config: EngineConfig) -> torch.nn.Module:
        log.append("load")
        return load(self, config)

    monkeypatch.setattr(engine_module, "free_memory", fake_free)
    monkeypatch.setattr(Engine, "_load_model", logged_load)
    yield log


@pytest.fixture
def build() -> Iterator[Callable[..., Engine]]:
    engines: List[Engine] = []

    def make(**kw: Any) -> Engine:
        kw = {"memory_ratio": 0.5, "cpu_kv_cache_bytes": 1 << 40, "max_seq_len_override": 64,
              "max_running_req": 2, "dtype": torch.float32, **kw}
        eng = Engine(EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 1), device="cpu", **kw))
        engines.append(eng)
        return eng

    yield make
    for e in engines:
        e.shutdown()


def test_engine_measures_free_memory_before_and_after_loading_the_model(events: List[str],
                                                                        build: Callable[..., Engine]) -> None:
    eng = build()
    assert events == ["free", "load", "free"]
    assert (eng.plan.init_free, eng.plan.model, eng.plan.reserve) == (BEFORE, BEFORE - AFTER, 0)


def test_engine_plan_reports_each_term(events: List[str], build: Callable[..., Engine]) -> None:
    eng = build()
    bpp = hand_bytes_per_page(page_size=1, itemsize=4)
    pages = expected_pages(bpp)
    assert eng.plan == MemoryPlan(init_free=BEFORE, model=BEFORE - AFTER, reserve=0, bytes_per_page=bpp,
                                  num_pages=pages, capped_by="memory_ratio")
    assert eng.num_pages == pages and eng.kv_cache.num_pages == pages + 1  # + the dummy request's page
    text = eng.plan.describe(1)
    for term in (f"{pages} pages", "free before load 0.04 GiB", "model 0.00 GiB", "activation reserve 0.00 GiB",
                 "bound by memory_ratio"):
        assert term in text, text


def test_engine_passes_memory_ratio(events: List[str], build: Callable[..., Engine]) -> None:
    eng = build(memory_ratio=0.25)
    assert eng.num_pages == expected_pages(hand_bytes_per_page(1, 4), ratio=0.25)


@pytest.mark.parametrize("page_size, dtype", [(16, torch.float32), (4, torch.bfloat16)])
def test_engine_bytes_per_page_from_the_model_config(events: List[str], build: Callable[..., Engine], page_size: int,
                                                     dtype: torch.dtype) -> None:
    eng = build(page_size=page_size, dtype=dtype)
    bpp = hand_bytes_per_page(page_size, dtype.itemsize)
    assert eng.plan.bytes_per_page == bpp
    assert eng.num_pages == expected_pages(bpp)


def test_engine_bytes_per_page_counts_this_ranks_kv_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TP a rank holds only its share of the KV heads: _determine_num_pages on an Engine holding one of two."""
    monkeypatch.setattr(engine_module, "free_memory", lambda device: AFTER)
    config = EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 2), dtype=torch.float32,
                          device="cpu", memory_ratio=0.5, cpu_kv_cache_bytes=1 << 40)
    p = bare_engine(num_kv_heads=1)._determine_num_pages(BEFORE, config)
    bpp = hand_bytes_per_page(1, 4, kv_heads=1)
    assert (p.bytes_per_page, p.num_pages) == (bpp, expected_pages(bpp))


def test_engine_takes_the_minimum_free_memory_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "free_memory", lambda device: BEFORE)
    monkeypatch.setattr(engine_module, "tp_min_over_ranks", lambda value: value - 12345)  # another rank has less
    assert bare_engine()._sync_get_memory() == BEFORE - 12345


def test_engine_passes_the_reserve(events: List[str], build: Callable[..., Engine],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    bpp = hand_bytes_per_page(1, 4)
    monkeypatch.setattr(Engine, "_activation_reserve", lambda self, config: 7 * bpp)
    eng = build()
    assert eng.plan.reserve == 7 * bpp
    assert eng.num_pages == expected_pages(bpp) - 7


def test_engine_applies_the_cpu_cap(events: List[str], build: Callable[..., Engine]) -> None:
    eng = build(cpu_kv_cache_bytes=100 * hand_bytes_per_page(1, 4))
    assert (eng.num_pages, eng.plan.capped_by) == (100, "cpu_kv_cache_bytes")


def test_cpu_cap_defaults_to_2_gib() -> None:
    config = EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 1), dtype=torch.float32)
    assert config.cpu_kv_cache_bytes == 2 << 30


def test_cpu_cap_binds_only_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """_determine_num_pages on an Engine placed on a CPU, then on a GPU: the same cap binds only on the CPU."""
    bpp = hand_bytes_per_page(1, 4)
    config = EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                          memory_ratio=0.5, cpu_kv_cache_bytes=100 * bpp)
    monkeypatch.setattr(engine_module, "free_memory", lambda device: AFTER)
    monkeypatch.setattr(Engine, "_activation_reserve", lambda self, config: 0)  # it measures on a real GPU
    for device, pages, bound in (("cpu", 100, "cpu_kv_cache_bytes"), ("cuda", expected_pages(bpp), "memory_ratio")):
        p = bare_engine(device)._determine_num_pages(BEFORE, config)
        assert (p.num_pages, p.capped_by) == (pages, bound), device


def test_engine_passes_num_page_override(events: List[str], build: Callable[..., Engine]) -> None:
    eng = build(num_page_override=37)
    assert (eng.num_pages, eng.plan.capped_by, eng.plan.model) == (37, "num_page_override", BEFORE - AFTER)
    assert eng.kv_cache.num_pages == 38


def test_engine_refuses_a_pool_of_fewer_than_two_pages(events: List[str], build: Callable[..., Engine]) -> None:
    with pytest.raises(ValueError, match="not enough memory for the KV cache: 1 page"):
        build(cpu_kv_cache_bytes=2 * hand_bytes_per_page(1, 4) - 1)


# ------------------------------------------------------------------------------------------ the MoE's peak
MOE_MODEL = "tiny-qwen3-moe"


def test_memory_probes_send_the_largest_prefill_through_every_moe_layer() -> None:
    """The reserve is measured (on CUDA) over run_model_probes in a scratch_context, which holds the engine's MoE
    backend: its prefill of max_forward_len tokens reaches every MoE layer whole, each token routed to its top-k
    experts (the largest grouped GEMMs and routing buffers), then the largest decode batch. The same probes, run
    here on the CPU, with a forward hook on each MoE block counting what it routed."""
    from engine.layers.moe import SparseMoE
    from engine.memory import run_model_probes, scratch_context
    from engine.moe.torch_backend import TorchMoE

    eng = Engine(EngineConfig(model_path=str(zoo.path(MOE_MODEL)), tp_info=DistributedInfo(0, 1),
                              dtype=torch.float32, device="cpu", num_page_override=64, max_seq_len_override=256,
                              max_prefill_tokens=96))
    seen: List[tuple] = []
    try:
        blocks = [m for m in eng.model.modules() if isinstance(m, SparseMoE)]
        hooks = [b.register_forward_hook(lambda m, args, out: seen.append(
            (m.moe_index, args[0].shape[0], type(eng.ctx.moe_backend).__name__))) for b in blocks]
        before = eng.ctx.moe_backend
        makers = (lambda pages: eng._make_kv_pool(eng.config, pages), lambda: eng._make_attn_backend(eng.config),
                  lambda: eng._make_moe_backend(eng.config))
        with torch.inference_mode(), scratch_context(eng.config, *makers) as max_bs:
            assert eng.ctx.moe_backend is not before  # the probes' own backend, of the engine's choice
            run_model_probes(eng.model, eng.config, max_bs)
        assert eng.ctx.moe_backend is before  # the context comes back as it was
        for h in hooks:
            h.remove()
    finally:
        eng.shutdown()
    top_k = eng.config.model_config.num_experts_per_tok
    assert len(blocks) == 3 and top_k == 2
    assert seen == [(i, 96, TorchMoE.__name__) for i in range(3)] + [(i, max_bs, TorchMoE.__name__) for i in range(3)]


@pytest.mark.cuda
def test_measured_reserve_covers_the_moe_peak() -> None:
    """On CUDA in bf16 (the fused backend): the engine's reserve is at least what one MoE block alone allocates at
    its peak over a prefill of max_forward_len tokens with spread routing (random hidden states)."""
    from engine.core import get_global_ctx
    from engine.layers.moe import SparseMoE

    eng = Engine(EngineConfig(model_path=str(zoo.path(MOE_MODEL)), tp_info=DistributedInfo(0, 1),
                              dtype=torch.bfloat16, max_seq_len_override=4096, max_running_req=16,
                              max_prefill_tokens=4096, num_page_override=1024))  # the reserve is measured anyway
    try:
        block = next(m for m in eng.model.modules() if isinstance(m, SparseMoE))
        x = torch.randn(eng.config.max_forward_len, eng.config.model_config.hidden_size, device=eng.device,
                        dtype=torch.bfloat16)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            assert get_global_ctx().moe_backend is not None
            block(x)
        torch.cuda.synchronize()
        moe_peak = torch.cuda.max_memory_allocated() - base
        print(f"reserve {eng.plan.reserve / 2**20:.1f} MiB, one MoE block at {x.shape[0]} tokens "
              f"{moe_peak / 2**20:.1f} MiB ({eng.config.moe_backend})")
        assert eng.config.moe_backend == "fused" and eng.plan.reserve >= moe_peak > 0
    finally:
        eng.shutdown()
