"""The engine paths parity walks. Each is one way a request can travel through the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParityPath:
    name: str
    description: str
    page_size: int = 1
    max_running_req: int = 16
    max_prefill_tokens: int = 4096
    forced: bool = True  # teacher-forced with the golden tokens, so every decode position is compared
    one_at_a_time: bool = False
    prefix: bool = False  # prefill the first half of each prompt, then extend over it as a cached prefix
    attention_backend: str = "auto"
    ops_backend: str = "auto"
    moe_backend: str = "auto"
    device_type: str = "any"  # "cuda": only on a GPU
    moe_only: bool = False  # only for mixture-of-experts models

    def applies_to(self, device: str, is_moe: bool = False) -> bool:
        return (self.device_type == "any" or device.startswith(self.device_type)) and (is_moe or not self.moe_only)


PATHS = (
    ParityPath("batch", "all prompts in one prefill batch, then batched decode; page_size 1"),
    ParityPath("single", "each prompt alone", one_at_a_time=True),
    ParityPath("paged", "page_size 16: prompts cross page boundaries", page_size=16),
    ParityPath("prefix", "half of each prompt prefilled first, the rest extended over the cached prefix; page_size 16",
               page_size=16, prefix=True),
    ParityPath("continuous", "3 slots, 64-token prefill budget: requests join while others decode, mixed prefill "
               "lengths; page_size 4", page_size=4, max_running_req=3, max_prefill_tokens=64),
    ParityPath("chunked", "5-token prefill budget: every longer prompt is prefilled in chunks, each an extend over its "
               "own cached prefix (across pages of 4 and sliding windows), the others decoding between its chunks",
               page_size=4, max_prefill_tokens=5),
    ParityPath("free", "free-running greedy generation (the engine's own tokens fed back)", forced=False),
    ParityPath("torch-backend", "the torch reference on the GPU: torch attention, torch ops and (MoE) the torch MoE "
               "(HF's numerics)", attention_backend="torch", ops_backend="torch", moe_backend="torch",
               device_type="cuda"),
    ParityPath("torch-ops", "FlashInfer attention with the torch ops instead of the fused kernels (on the GPU)",
               ops_backend="torch", device_type="cuda"),
    ParityPath("torch-moe", "the fast path with the torch MoE reference instead of the fused grouped GEMMs (decode "
               "without CUDA graphs: the reference reads its routing on the host)", moe_backend="torch",
               device_type="cuda", moe_only=True),
)
