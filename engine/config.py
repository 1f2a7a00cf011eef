"""EngineConfig: frozen; "auto" choices are resolved by Engine into a new config (dataclasses.replace)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, List

import torch

from engine.distributed import DistributedInfo
from engine.utils.hf import cached_load_hf_config

if TYPE_CHECKING:
    from engine.models import ModelConfig

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tp_info: DistributedInfo
    dtype: torch.dtype
    device: str = "auto"  # auto: cuda:<rank> with a GPU, cpu otherwise
    max_running_req: int = 256
    attention_backend: str = "auto"  # auto: flashinfer on CUDA (half precision), cpu on a CPU in fp32, else torch
    # norms, RoPE, activations, GEMMs: auto = FlashInfer's fused kernels on CUDA (half precision), oneDNN's GEMMs on
    # a CPU in fp32, torch's else
    ops_backend: str = "auto"
    moe_backend: str = "auto"  # MoE models: auto = fused grouped GEMMs on CUDA in bf16, the torch reference otherwise
    cuda_graph_bs: List[int] | None = None  # None: 1, 2, 4, 8, then every 8 up to cuda_graph_max_bs
    cuda_graph_max_bs: int | None = None  # None: min(max_running_req, 256); 0 disables graphs
    # Prefill and extend CUDA graphs (CUDA with FlashInfer only): the most tokens one graph forward carries (graphs
    # at 128, 256, ... below it and at it); None: min(4096, max_forward_len) when graphs are on (cuda_graph_max_bs
    # not 0); 0 disables them. A prefill batch of more requests than prefill_graph_max_reqs runs eagerly.
    prefill_graph_tokens: int | None = None
    prefill_graph_max_reqs: int = 8  # capped at max_running_req
    page_size: int = 1
    memory_ratio: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30  # the KV pool is capped at 2 GiB on a CPU by default
    distributed_timeout: float = 60.0
    distributed_port: int = 2333
    use_dummy_weight: bool = False
    max_seq_len_override: int | None = None
    num_page_override: int | None = None
    max_prefill_tokens: int | None = None  # most tokens one forward may carry (None: max_seq_len); sizes the reserve
    seed: int = 42  # torch's seed and the sampler's: requests without a seed of their own draw from it
    record_router_margins: bool = False  # MoE: hand back each token's router margins with the logits (parity)
    # a request's logits, and so its greedy and seeded tokens, are bitwise the same whatever else is in its batch:
    # the torch kernels with GEMMs and activations whose rows do not depend on the batch's, and attention per request
    # (engine/batch_invariant.py); the CPU only
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not (0.0 < self.memory_ratio <= 1.0):
            raise ValueError(f"memory_ratio must lie in (0, 1], got {self.memory_ratio}")
        if self.max_running_req < 1:
            raise ValueError(f"max_running_req must be >= 1, got {self.max_running_req}")
        if self.prefill_graph_tokens is not None and self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0 (0 disables prefill graphs), got "
                             f"{self.prefill_graph_tokens}")
        if self.prefill_graph_max_reqs < 1:
            raise ValueError(f"prefill_graph_max_reqs must be >= 1, got {self.prefill_graph_max_reqs}")
        if self.max_seq_len_override is not None and self.max_seq_len_override < 1:
            raise ValueError(f"max_seq_len_override must be >= 1, got {self.max_seq_len_override}")

    @cached_property
    def hf_config(self) -> Any:
        return cached_load_hf_config(self.model_path)

    @cached_property
    def model_config(self) -> "ModelConfig":
        from engine.models import ModelConfig

        return ModelConfig.from_hf(self.hf_config)

    @property
    def max_seq_len(self) -> int:
        if self.max_seq_len_override is not None:
            return self.max_seq_len_override
        return self.model_config.rotary_config.max_position

    @property
    def max_forward_len(self) -> int:
        return min(self.max_seq_len, self.max_prefill_tokens or self.max_seq_len)

    @property
    def distributed_addr(self) -> str:
        return f"tcp://127.0.0.1:{self.distributed_port}"
