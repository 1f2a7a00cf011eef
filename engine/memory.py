"""Memory planning: how many KV pages fit, and how much the forward passes need beside them."""

from __future__ import annotations

from dataclasses import dataclass

from engine.utils.misc import gib


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
