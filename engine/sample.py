"""The sampler: parameters laid out as tensors on the host side, one batched draw on the device.

Semantics, per request: temperature; top-k (-1 = none) first, then top-p on the renormalized rest; min_p on the
full tempered distribution, intersected with both; the most likely token always survives. An all-greedy batch is an
argmax with no softmax; greedy rows in a mixed batch get temperature 1e-6 and their draw is then replaced by the
argmax: 1e-6 alone does not collapse exact ties (common in bf16 logits) or logits closer than ~1e-5, so such a row
would otherwise depend on which batch it ran in.
A row whose logits contain NaN or have no finite maximum gets token -1 and the other rows are drawn as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core import Batch
from engine.utils.device import make_device_tensor

MIN_T = MIN_P = 1e-6
INVALID_TOKEN = -1


@dataclass
class BatchSamplingArgs:
    temperatures: torch.Tensor | None  # [bs] float32; None = all greedy
    top_k: torch.Tensor | None = None  # [bs] int32; None = no row limits it
    top_p: torch.Tensor | None = None  # [bs] float32
    min_p: torch.Tensor | None = None  # [bs] float32
    greedy: torch.Tensor | None = None  # [bs] bool: rows answered by the argmax; None = no greedy row


@dataclass
class Sampler:
    device: torch.device
    vocab_size: int
    generator: torch.Generator | None = None  # seeded draws; None uses the global RNG (seeded by the Engine)

    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        """Lay the batch's sampling parameters out as device tensors (host side, before the forward)."""
        params = [r.sampling_params for r in batch.reqs]
        if all(p.is_greedy for p in params):
            return BatchSamplingArgs(temperatures=None)
        ts = [max(0.0 if p.is_greedy else p.temperature, MIN_T) for p in params]
        top_ks = [p.top_k if p.top_k >= 1 and not p.is_greedy else self.vocab_size for p in params]
        top_ps = [1.0 if p.is_greedy else min(max(p.top_p, MIN_P), 1.0) for p in params]
        min_ps = [0.0 if p.is_greedy else p.min_p for p in params]

        def tensor_if(values: list, unlimited: float, dtype: torch.dtype) -> torch.Tensor | None:
            return make_device_tensor(values, dtype, self.device) if any(v != unlimited for v in values) else None

        return BatchSamplingArgs(
            temperatures=make_device_tensor(ts, torch.float32, self.device),
            top_k=tensor_if([min(k, self.vocab_size) for k in top_ks], self.vocab_size, torch.int32),
            top_p=tensor_if(top_ps, 1.0, torch.float32),
            min_p=tensor_if(min_ps, 0.0, torch.float32),
            greedy=tensor_if([p.is_greedy for p in params], False, torch.bool),
        )

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        """logits [bs, vocab] -> tokens [bs] int64 (-1 for a row with NaN or no finite maximum)."""
        if args.temperatures is None:
            top, tokens = logits.max(dim=-1)  # max propagates NaN, so a NaN row has a non-finite top
            return torch.where(torch.isfinite(top), tokens, INVALID_TOKEN)
        valid = torch.isfinite(logits.amax(dim=-1))
        logits = torch.where(valid.unsqueeze(1), logits.float(), 0.0)
        impl = sample_torch
        if logits.is_cuda and args.min_p is None:
            try:
                import flashinfer.sampling  # noqa: F401

                impl = sample_flashinfer
            except ImportError:
                pass
        tokens = impl(logits, args.temperatures, args.top_k, args.top_p, args.min_p, self.generator)
        if args.greedy is not None:
            tokens = torch.where(args.greedy, torch.argmax(logits, dim=-1), tokens)
        return torch.where(valid, tokens, INVALID_TOKEN)


def filtered_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """[bs, vocab] probabilities after temperature, top-k, top-p (on the top-k renormalized rest) and min_p."""
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    keep = None
    if min_p is not None:  # on the full tempered distribution, before the other filters
        keep = probs >= probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    if top_k is not None or top_p is not None:
        # stable: among equal probabilities the lower token id ranks first (the documented tie rule)
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
        if top_k is not None:
            rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
            sorted_probs = sorted_probs.masked_fill(rank >= top_k.unsqueeze(1), 0.0)
        if top_p is not None:
            sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass ranked ahead of each token
            sorted_probs = sorted_probs.masked_fill(before >= top_p.unsqueeze(1), 0.0)
        probs = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs)
    if keep is not None:
        probs = probs * keep
    return probs


def sample_torch(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Each request may have its own temperature, top-k, top-p and min_p. Like FlashInfer, top-k comes first."""
    probs = filtered_probs(logits, temperatures, top_k, top_p, min_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def sample_flashinfer(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, min_p: torch.Tensor | None = None,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """FlashInfer's rejection sampling: no sort, the same distribution as sample_torch (min_p goes through torch)."""
    import flashinfer.sampling as fs

    assert min_p is None, "min_p is sampled by sample_torch"
    logits = logits / temperatures.unsqueeze(1)
    if top_k is None and top_p is None:
        return fs.sampling_from_logits(logits, generator=generator)
    probs = torch.softmax(logits, dim=-1)
    if top_p is None:
        return fs.top_k_sampling_from_probs(probs, top_k, generator=generator)
    if top_k is None:
        return fs.top_p_sampling_from_probs(probs, top_p, generator=generator)
    return fs.top_k_top_p_sampling_from_probs(probs, top_k, top_p, filter_apply_order="top_k_first",
                                              generator=generator)
