"""HF's model on the CPU or a GPU: loading it, running it at a thread count, the statistics its runs are summarised by.
Shared by the golden (harness.golden) and its float64 reference (harness.golden_reference)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from engine.moe.base import router_margin
from engine.utils.device import physical_cores
from harness.models import ModelRef, as_model


def hf_model(model: ModelRef | str, device: str, dtype: torch.dtype, attn: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    ref = as_model(model)
    # torch's grouped_mm, HF's default for experts, has no float64 kernel: the exact reference loops over experts
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 and ref.is_moe else {}
    return AutoModelForCausalLM.from_pretrained(ref.folder, dtype=dtype, attn_implementation=attn,
                                                **experts).to(device).eval()


def spread_summary(errs: Sequence[float], kls: Sequence[float]) -> Dict[str, Any]:
    """Distribution of per-position errors and KLs: the statistics parity's half-precision gate compares."""
    e, k = np.asarray(errs, dtype=np.float64), np.asarray(kls, dtype=np.float64)
    return {"positions": int(e.size), **{f"{name}_{q}": float(np.quantile(x, v)) for name, x in (("err", e), ("kl", k))
                                         for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "err_max": float(e.max()), "err_mean": float(e.mean()), "kl_max": float(k.max()),
            "kl_mean": float(k.mean())}


def router_margins(out: Any, n: int, top_k: int) -> np.ndarray:
    """[n]: each position's smallest router margin over the MoE layers of an HF forward run with
    output_router_logits."""
    return torch.stack([router_margin(r.reshape(n, -1), top_k) for r in out.router_logits]).amin(0).cpu().numpy()


def spread_threads(device: str) -> List[int | None]:
    """The thread counts HF's spread covers: on the CPU 1, 2 and all cores (a user's run may use any of them, and a
    product's bits follow its split across threads); None on a GPU (the current setting)."""
    return [None] if device.split(":")[0] != "cpu" else sorted({1, min(2, physical_cores()), physical_cores()})


def at_threads(model: Any, threads: int | None, full: torch.Tensor, kw: Dict[str, Any]) -> Any:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return model(full, **kw)
    finally:
        torch.set_num_threads(before)
