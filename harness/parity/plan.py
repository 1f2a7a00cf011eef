"""What a parity path runs: the engine's configuration and the driver's arguments for the golden's prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from engine.core import SamplingParams
from harness import golden as G
from harness.parity.paths import ParityPath


@dataclass
class PathPlan:
    """What one path runs: the engine's config and, per group of prompts run together, the driver's arguments."""

    engine_kwargs: Dict[str, Any]
    params: List[SamplingParams]  # per prompt: as many new tokens as its golden has
    groups: List[List[int]]
    prompts: List[List[int]]
    args: List[Dict[str, Any]]  # per group: forced, prefix_lens
    max_prefill_tokens: int


def plan_path(path: ParityPath, device: str, dtype: str, gs: G.GoldenSet, batch_invariant: bool = False) -> PathPlan:
    longest = max(len(p.prompt_ids) + len(p.tokens) for p in gs.prompts)
    kw = dict(dtype=getattr(torch, dtype), device=device, page_size=path.page_size,
              max_running_req=path.max_running_req, num_page_override=16384 // path.page_size,
              max_seq_len_override=max(512, -(-longest // 256) * 256), attention_backend=path.attention_backend,
              ops_backend=path.ops_backend, moe_backend=path.moe_backend, record_router_margins=True,
              batch_invariant=batch_invariant)
    prompts = [pg.prompt_ids.tolist() for pg in gs.prompts]
    forced = [pg.tokens.tolist() for pg in gs.prompts] if path.forced else None
    groups = [[i] for i in range(len(prompts))] if path.one_at_a_time else [list(range(len(prompts)))]
    args = [dict(forced=None if forced is None else [forced[i] for i in group],
                 prefix_lens=[len(prompts[i]) // 2 for i in group] if path.prefix else None) for group in groups]
    params = [SamplingParams(max_tokens=len(pg.tokens), ignore_eos=True) for pg in gs.prompts]
    return PathPlan(kw, params, groups, prompts, args, path.max_prefill_tokens)
