"""An independent float64 oracle of the sampler's filtered distribution (numpy only; never calls engine.sample).

The specification it encodes, per row of logits:
  1. temperature 0, or top_k 1, is greedy: all mass on the argmax (the lowest id among equal maxima).
  2. p = softmax(logits / temperature), computed in float64 from the float32 logits.
  3. rank the tokens by p, descending; equal probabilities rank by token id, lower first (a stable sort).
  4. top-k (-1 = no limit) keeps the first k ranks; the kept mass is renormalized to 1.
  5. top-p keeps a token when the renormalized mass ranked strictly ahead of it is < top_p, so the first rank
     always survives and the token that crosses top_p is kept.
  6. min_p keeps tokens with p >= max(p) * min_p, p being the full tempered distribution (before top-k).
  7. the kept set is the intersection of 4-6; the result is p restricted to it, renormalized.
A row with a NaN or without a finite maximum has no distribution (the sampler must answer token -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Filtered:
    probs: np.ndarray | None  # [vocab] float64 summing to 1; None for an invalid row
    # the smallest distance between a top-p or min_p comparison and its threshold: a float32 sampler may decide a
    # comparison closer than ~1e-6 differently, so cases are built to keep this margin clear of it
    margin: float = float("inf")


def softmax64(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def filtered_distribution(logits: np.ndarray, temperature: float, top_k: int = -1, top_p: float = 1.0,
                          min_p: float = 0.0) -> Filtered:
    """The distribution a correct sampler draws one row from (see the module docstring for the rules)."""
    logits = np.asarray(logits, dtype=np.float64)
    if np.isnan(logits).any() or not np.isfinite(logits.max()):
        return Filtered(None)
    vocab = logits.shape[0]
    if temperature == 0.0 or top_k == 1:
        one_hot = np.zeros(vocab)
        one_hot[int(np.argmax(logits))] = 1.0  # np.argmax returns the first maximum: the lowest id
        return Filtered(one_hot)
    p = softmax64(logits, temperature)
    order = np.argsort(-p, kind="stable")  # stable: equal probabilities keep id order, lower id first
    ranked = p[order]
    k = vocab if top_k == -1 else min(top_k, vocab)
    in_top_k = np.arange(vocab) < k
    renormed = np.where(in_top_k, ranked, 0.0) / ranked[:k].sum()
    ahead = np.concatenate([[0.0], np.cumsum(renormed)[:-1]])  # mass ranked strictly ahead of each rank
    keep_ranked = in_top_k & (ahead < top_p)
    keep = np.zeros(vocab, dtype=bool)
    keep[order] = keep_ranked
    margins = [np.abs(ahead[in_top_k] - top_p).min()] if top_p < 1.0 else []
    if min_p > 0.0:
        keep &= p >= p.max() * min_p
        margins.append(np.abs(p / p.max() - min_p).min())
    kept = np.where(keep, p, 0.0)
    return Filtered(kept / kept.sum(), float(min(margins, default=np.inf)))
