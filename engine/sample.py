"""The sampler: parameters laid out as tensors on the host side, one batched draw on the device.

Semantics, per request, the same on every device (harness/sampling/oracle.py is their float64 reference):
- temperature 0, or top_k 1, is greedy: the argmax, the lowest id among equal maxima. An all-greedy batch is an argmax
  with no softmax. Greedy rows in a mixed batch get temperature 1e-6 for the shared path and their draw is then
  replaced by the argmax: 1e-6 alone does not collapse exact ties (common in bf16 logits).
- p = softmax(logits / temperature).
- top-k (-1 = none) keeps every token whose probability is >= the k-th largest: all tokens tied with the k-th stay.
- top-p works on the top-k-renormalized rest: ranked by probability, the crossing token is the first at which the
  cumulative mass reaches top_p; every token with a probability >= the crossing token's stays (so the crossing token
  and everything tied with it). The most likely token always stays.
- min_p keeps tokens with p >= max(p) * min_p on the full tempered distribution, intersected with the above.
No rule depends on the order of equal probabilities. FlashInfer's renorm kernels (CUDA, no sort) and the torch filter
(any device, one sort of the values) implement the same rule.

The draw is an inverse CDF (float64) at one uniform per row; on CUDA it is one Triton program a row, with the softmax in
it when temperature is the only filter (kernels/sample_kernel.py). A row's uniform is a hash of (seed, request,
position): a request's tokens depend on its seed and its own logits only, not on its batch-mates, its row or a device
RNG. Every `sample` call on the same args is a new draw: the first reads the uniforms `prepare` laid out (what the
request gets in any batch and either driver loop, which sample once per prepare), the d-th hashes (key, d), so a caller
that samples twice from one args (best-of-n, a retry) gets independent tokens, the same ones in every run. A row whose
logits contain NaN or have no finite maximum gets token -1 and the other rows are drawn as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.core import Batch, SamplingParams
from engine.utils.device import has_flashinfer, has_triton, make_device_tensor

MIN_T = MIN_P = 1e-6
INVALID_TOKEN = -1
# from this many rows an all-greedy batch's argmax is kernels/sample_kernel.py's (one program a row); below, torch's
# max, which splits a row over many programs (H200, Qwen3's vocabulary: 22.1 against 24.8 us at 64 rows, 22.0 against
# 20.6 at 32)
ARGMAX_KERNEL_ROWS = 64


@dataclass
class BatchSamplingArgs:
    temperatures: torch.Tensor | None  # [bs] float32; None = all greedy
    top_k: torch.Tensor | None = None  # [bs] int32; None = no row limits it
    top_p: torch.Tensor | None = None  # [bs] float32
    min_p: torch.Tensor | None = None  # [bs] float32
    greedy: torch.Tensor | None = None  # [bs] bool: rows answered by the argmax; None = no greedy row
    uniforms: torch.Tensor | None = None  # [bs] float64 in [0, 1): where each row's inverse CDF is read
    # [bs, 4] int64 on the host: each row's key; None = the caller's uniforms serve every draw (or a device RNG)
    keys: np.ndarray | None = None
    draws: int = 0  # sample calls made on these args so far

    def next_uniforms(self, device: torch.device) -> torch.Tensor | None:
        """The uniforms of this draw, counting it: draw 0 reads the prepared uniforms, draw d > 0 hashes (key, d)."""
        if self.keys is not None and self.draws > 0:
            column = np.full((len(self.keys), 1), self.draws, dtype=np.int64)
            self.uniforms = make_device_tensor(row_uniforms(np.hstack([self.keys, column])).tolist(), torch.float64,
                                               device)
        self.draws += 1
        return self.uniforms


@dataclass
class Sampler:
    device: torch.device
    vocab_size: int
    seed: int = 0  # the stream of requests without a seed of their own

    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        """Lay the batch's sampling parameters out as device tensors (host side, before the forward)."""
        params = [r.sampling_params for r in batch.reqs]
        if all(p.is_greedy for p in params):
            return BatchSamplingArgs(temperatures=None)
        ts = [max(0.0 if p.is_greedy else p.temperature, MIN_T) for p in params]
        top_ks = [min(p.top_k, self.vocab_size) if p.top_k >= 1 and not p.is_greedy else self.vocab_size
                  for p in params]
        top_ps = [1.0 if p.is_greedy else min(max(p.top_p, MIN_P), 1.0) for p in params]
        min_ps = [0.0 if p.is_greedy else p.min_p for p in params]
        # the token sampled now lands at position device_len
        keys = np.array([self._key(p, r.uid, r.device_len) for p, r in zip(params, batch.reqs)], dtype=np.int64)

        def tensor_if(values: list, unlimited: float, dtype: torch.dtype) -> torch.Tensor | None:
            return make_device_tensor(values, dtype, self.device) if any(v != unlimited for v in values) else None

        return BatchSamplingArgs(
            temperatures=make_device_tensor(ts, torch.float32, self.device),
            top_k=tensor_if(top_ks, self.vocab_size, torch.int32),
            top_p=tensor_if(top_ps, 1.0, torch.float32),
            min_p=tensor_if(min_ps, 0.0, torch.float32),
            greedy=tensor_if([p.is_greedy for p in params], False, torch.bool),
            uniforms=make_device_tensor(row_uniforms(keys).tolist(), torch.float64, self.device),
            keys=keys,
        )

    def _key(self, params: SamplingParams, uid: int, position: int) -> tuple[int, int, int, int]:
        """A request with a seed of its own draws from that seed alone (the same prompt and seed give the same
        tokens in any batch and any run); the others from the sampler's seed and their uid."""
        if params.seed is not None:
            return (1, params.seed, 0, position)
        return (0, self.seed, uid, position)

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        """logits [bs, vocab] -> tokens [bs] int64 (-1 for a row with NaN or no finite maximum)."""
        kernels = logits.is_cuda and has_triton()
        if args.temperatures is None:
            if kernels and logits.shape[0] >= ARGMAX_KERNEL_ROWS:
                from engine.kernels.sample_kernel import argmax

                return argmax(logits.contiguous())
            top, tokens = logits.max(dim=-1)  # max propagates NaN, so a NaN row has a non-finite top
            # |top| < inf is isfinite (False for NaN and +-inf) in two kernels; torch.isfinite is eq, abs, ne and mul
            return torch.where(top.abs() < math.inf, tokens, INVALID_TOKEN)
        uniforms = args.next_uniforms(self.device)
        if kernels and args.top_k is None and args.top_p is None and args.min_p is None:
            # temperature alone: one kernel over the logits as they are, -1 for a bad row (kernels/sample_kernel.py)
            from engine.kernels.sample_kernel import draw

            tokens = draw(logits.contiguous(), _uniforms_or_random(uniforms, logits.shape[0], logits.device, None),
                          args.temperatures)
            if args.greedy is not None:
                tokens = torch.where(args.greedy & (tokens >= 0), torch.argmax(logits, dim=-1), tokens)
            return tokens
        valid = torch.isfinite(logits.amax(dim=-1))
        logits = torch.where(valid.unsqueeze(1), logits.float(), 0.0)
        impl = sample_flashinfer if logits.is_cuda and has_flashinfer() else sample_torch
        tokens = impl(logits, args.temperatures, args.top_k, args.top_p, args.min_p, uniforms)
        if args.greedy is not None:
            tokens = torch.where(args.greedy, torch.argmax(logits, dim=-1), tokens)
        return torch.where(valid, tokens, INVALID_TOKEN)


# ---------------------------------------------------------------------------------------------- the filters
def filtered_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """[bs, vocab] probabilities after temperature, top-k, top-p and min_p (unnormalized: the draw normalizes).

    top-k and top-p both keep the tokens at or above a threshold probability, so the kept set is p >= the larger of
    the two thresholds; only the sorted values are needed, never an order among equal ones."""
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    keep = None
    if min_p is not None:  # on the full tempered distribution
        keep = probs >= probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    if top_k is not None or top_p is not None:
        vocab = probs.shape[1]
        ranked = probs.sort(dim=-1, descending=True).values
        threshold = torch.zeros_like(probs[:, 0])
        if top_k is not None:
            threshold = ranked.gather(1, (top_k.long() - 1).clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
            ranked = ranked.masked_fill(ranked < threshold.unsqueeze(1), 0.0)
        if top_p is not None:
            # of the top-k-renormalized rest; the total is the scan's last entry: one row's sum, whatever the batch
            # (a lone row's sum() is split across threads on a CPU, a batch's is not)
            cumulative = ranked.cumsum(dim=-1)
            mass = cumulative / cumulative[:, -1:]
            crossing = (mass < top_p.unsqueeze(1)).sum(dim=-1).clamp(max=vocab - 1)
            p_cross = ranked.gather(1, crossing.unsqueeze(1)).squeeze(1)
            # top_p 1 keeps everything, however the cumulative sum rounds near 1
            threshold = torch.maximum(threshold, torch.where(top_p >= 1.0, 0.0, p_cross))
        above = probs >= threshold.unsqueeze(1)
        keep = above if keep is None else keep & above
    return probs if keep is None else probs * keep


def filtered_probs_flashinfer(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                              top_p: torch.Tensor | None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The same filter through FlashInfer's sort-free renorm kernels: top-k keeps values >= its pivot (the k-th
    largest), top-p keeps values whose strictly larger mass is < top_p, which are the rules above."""
    import flashinfer.sampling as fs

    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    kept = probs
    if top_k is not None:
        kept = fs.top_k_renorm_probs(kept, top_k)
    if top_p is not None:
        kept = fs.top_p_renorm_probs(kept, top_p)
    if min_p is not None:
        kept = kept * (probs >= probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1))
    return kept


# ---------------------------------------------------------------------------------------------- the draw
def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds u x total mass, per row. The CDF is summed in float64, so no tail token's
    mass is lost to rounding; u < 1 keeps the point below the total, so the token found has positive mass. On CUDA
    one Triton program a row (kernels/sample_kernel.py), in place of a float64 copy, scan and search of the whole
    matrix."""
    if probs.is_cuda and has_triton():
        from engine.kernels.sample_kernel import draw

        return draw(probs.contiguous(), uniforms)
    cdf = probs.double().cumsum(dim=-1)
    point = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, point, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _uniforms_or_random(uniforms: torch.Tensor | None, rows: int, device: torch.device,
                        generator: torch.Generator | None) -> torch.Tensor:
    if uniforms is not None:
        return uniforms
    return torch.rand(rows, dtype=torch.float64, device=device, generator=generator)


def sample_torch(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None = None,
                 uniforms: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Each request may have its own temperature, top-k, top-p and min_p; top-k comes first, then top-p.
    uniforms [bs] float64 (None: drawn from `generator`)."""
    probs = filtered_probs(logits, temperatures, top_k, top_p, min_p)
    return inverse_cdf(probs, _uniforms_or_random(uniforms, probs.shape[0], probs.device, generator))


def sample_flashinfer(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, min_p: torch.Tensor | None = None,
                      uniforms: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """sample_torch with FlashInfer's filters (CUDA): the same distribution and, at the same uniforms, the same
    tokens wherever the two filters' float32 probabilities agree."""
    probs = filtered_probs_flashinfer(logits, temperatures, top_k, top_p, min_p)
    return inverse_cdf(probs, _uniforms_or_random(uniforms, probs.shape[0], probs.device, generator))


# ---------------------------------------------------------------------------------------------- per-row uniforms
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 in which every input bit moves every output bit."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def row_uniforms(keys: np.ndarray) -> np.ndarray:
    """keys [rows, n] int64 -> [rows] float64 uniforms in [0, 1 - 2^-53]: a hash of each row's key (counter-based,
    so a key gives the same number on every device, in every batch, in every run)."""
    h = np.zeros(keys.shape[0], dtype=np.uint64)
    for column in keys.astype(np.uint64).T:
        h = _mix((h ^ column) + _GOLDEN)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
