"""One logprob row against a golden row: the measure parity applies to the engine and the golden applies to HF's own
sdpa-vs-eager spread."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PositionStat:
    err: float  # max |engine - golden| logprob on the golden's top-K ids
    kl: float
    tv: float
    argmax: int
    top_ids: np.ndarray  # the engine's top-K ids
    top_lp: np.ndarray  # and their log-probabilities


# Mixture-of-experts models: the router margin (engine.moe.router_margin, relative to the row's largest |router logit|)
# at or below which a routing choice is a near tie. fp32: the engine's logits agree with HF's to 1e-5 of their scale
# (tests/test_engine.py's bound); bf16 / fp16: two units in the last place of the largest logit (eps 2^-7 / 2^-10): one
# for the logits' own rounding, one for the router input's. On tiny-qwen3-moe's golden positions 18% of the engine's
# fp32 margins lie under the bf16 one, 0 under the fp32 one (tests/test_moe.py)
ROUTER_TIE = {"float32": 1e-5, "bfloat16": 2.0 ** -6, "float16": 2.0 ** -9}


def compare_row(engine_lp: torch.Tensor, ids: np.ndarray, ref_lp: np.ndarray) -> PositionStat:
    """engine_lp [vocab] float32 log-probabilities against the golden's top-K row."""
    e = engine_lp[torch.from_numpy(ids.astype(np.int64))].double().numpy()
    r = ref_lp.astype(np.float64)
    p, q = np.exp(r), np.exp(e)
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 0.0)
    kl = float(np.sum(p * (r - e)) + (p_rest * np.log(p_rest / q_rest) if p_rest > 1e-12 and q_rest > 0 else 0.0))
    tv = 0.5 * float(np.abs(p - q).sum() + abs(p_rest - q_rest))
    top = engine_lp.topk(len(ids))
    return PositionStat(float(np.abs(e - r).max()), max(kl, 0.0), tv, int(top.indices[0]), top.indices.numpy(),
                        top.values.numpy())


def compare_topk(ids: np.ndarray, lp: np.ndarray, golden_ids: np.ndarray, golden_lp: np.ndarray) -> PositionStat:
    """An engine that returns only its own top-k (ids, lp: by descending log-probability, -1 / -inf padded) against
    the golden's top-K row. A golden id the engine ranks in its top-k is compared exactly. One it does not has an
    engine log-probability at most the engine's k-th, so where the golden's exceeds that, |engine - golden| >= the
    difference: err is exact when the engine's top-k holds every golden id, else a lower bound. KL and TV are taken
    over the ids both rank plus one "rest" bucket: lower bounds of the full ones (merging categories never raises
    either). So a FAIL is certain; a PASS says the rows agree as far as both sides' top-k show."""
    valid = ids >= 0
    ids, lp = ids[valid], lp[valid].astype(np.float64)
    engine = dict(zip(ids.tolist(), lp.tolist()))
    kth = float(lp.min()) if len(lp) else float("-inf")
    r = golden_lp.astype(np.float64)
    known = np.array([i in engine for i in golden_ids.tolist()])
    e_known = np.array([engine.get(i, np.nan) for i in golden_ids.tolist()])
    err = np.where(known, np.abs(e_known - r), np.maximum(r - kth, 0.0))
    p, q = np.exp(r[known]), np.exp(e_known[known])
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 0.0)
    kl = float(np.sum(p * (r[known] - e_known[known])) +
               (p_rest * np.log(p_rest / q_rest) if p_rest > 1e-12 and q_rest > 0 else 0.0))
    tv = 0.5 * float(np.abs(p - q).sum() + abs(p_rest - q_rest))
    k = len(golden_ids)
    top_ids = np.full(k, -1, dtype=np.int64)
    top_lp = np.full(k, np.nan, dtype=np.float32)
    top_ids[:min(k, len(ids))], top_lp[:min(k, len(ids))] = ids[:k], lp[:k]
    return PositionStat(float(err.max()), max(kl, 0.0), tv, int(ids[0]) if len(ids) else -1, top_ids, top_lp)
