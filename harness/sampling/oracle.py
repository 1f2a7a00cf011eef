"""An independent float64 oracle of the sampler's filtered distribution (numpy only; never calls engine.sample).

The specification it encodes, per row of logits:
  1. temperature 0, or top_k 1, is greedy: all mass on the argmax (the lowest id among equal maxima).
  2. p = softmax(logits / temperature), computed in float64 from the float32 logits.
  3. top-k (-1 = no limit) keeps every token whose probability is >= the k-th largest probability: every token tied
     with the k-th stays. The kept mass is renormalized to 1.
  4. top-p: ranking the kept tokens by renormalized probability, the crossing token is the first at which the
     cumulative mass reaches top_p (>= top_p); top-p keeps every token whose probability is >= the crossing token's.
     The crossing token and every token tied with it stay, so nothing depends on an order among equal probabilities.
  5. min_p keeps tokens with p >= max(p) * min_p, p being the full tempered distribution (before top-k).
  6. the kept set is the intersection of 3-5; the result is p restricted to it, renormalized.
A row with a NaN or without a finite maximum has no distribution (the sampler must answer token -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Filtered:
    probs: np.ndarray | None  # [vocab] float64 summing to 1; None for an invalid row
    # the smallest relative distance between a comparison the filters make and its threshold (the top-k boundary
    # against the next lower probability, a tie block's cumulative mass against top_p, p / max(p) against min_p): a
    # float32 sampler may decide a comparison closer than ~1e-6 differently, so cases keep this margin clear of it
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
    ranked = np.sort(p)[::-1]
    margins = []
    keep = np.ones(vocab, dtype=bool)
    if top_k != -1 and top_k < vocab:
        kth = ranked[top_k - 1]
        keep &= p >= kth
        below = ranked[ranked < kth]
        if len(below) and below[0] > 0:
            margins.append((kth - below[0]) / kth)
    if top_p < 1.0:
        q = p / p[keep].sum()  # the top-k-renormalized distribution
        kept = np.sort(q[keep])[::-1]
        mass = np.cumsum(kept)
        crossing = min(int(np.searchsorted(mass, top_p, side="left")), len(kept) - 1)  # first mass >= top_p
        keep &= q >= kept[crossing]
        block_ends = np.flatnonzero(np.append(kept[1:] != kept[:-1], True))  # the last rank of each tie block
        margins.append(np.abs(mass[block_ends] - top_p).min())
    if min_p > 0.0:
        keep &= p >= p.max() * min_p
        margins.append(np.abs(p / p.max() - min_p).min())
    kept_p = np.where(keep, p, 0.0)
    return Filtered(kept_p / kept_p.sum(), float(min(margins, default=np.inf)))
