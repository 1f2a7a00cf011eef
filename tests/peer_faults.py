"""Engines with a fault of known size, for the doors' tests (tests/test_peers.py): each is this project's Engine
with one rule of its sampler changed, a weight scaled, or its forward's work quadrupled. A test names one as --engine
python:peer_faults:CLASS, or serves it with `python -m harness serve --engine python:peer_faults:CLASS`."""

from __future__ import annotations

import os

import torch

from engine import Engine
from engine.sample import BatchSamplingArgs, Sampler, inverse_cdf


class _RuleSampler(Sampler):
    """The spec's sampler with its filter replaced (rows with temperature; greedy rows as the spec's)."""

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        if args.temperatures is None:
            return super().sample(logits, args)
        probs = self.filter(logits.float(), args)
        tokens = inverse_cdf(probs, args.next_uniforms(self.device))
        return tokens if args.greedy is None else torch.where(args.greedy, logits.argmax(dim=-1), tokens)

    def filter(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        raise NotImplementedError


class _TopPOfFullMass(_RuleSampler):
    """top-p over the full tempered distribution instead of the top-k-renormalized one: the order of top-k and top-p
    that several engines follow, not the spec's."""

    def filter(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        probs = torch.softmax(logits / args.temperatures.unsqueeze(1), dim=-1)
        ranked = probs.sort(dim=-1, descending=True).values
        keep = torch.ones_like(probs, dtype=torch.bool)
        if args.top_k is not None:
            keep &= probs >= ranked.gather(1, (args.top_k.long() - 1).unsqueeze(1))
        if args.top_p is not None:
            crossing = (ranked.cumsum(dim=-1) < args.top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
            keep &= probs >= ranked.gather(1, crossing.clamp(max=probs.shape[1] - 1))
        if args.min_p is not None:
            keep &= probs >= probs.amax(dim=-1, keepdim=True) * args.min_p.unsqueeze(1)
        return probs * keep


class _MinPUntempered(_RuleSampler):
    """min-p against the untempered distribution (temperature 1) instead of the tempered one."""

    def filter(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        from engine.sample import filtered_probs

        probs = filtered_probs(logits, args.temperatures, args.top_k, args.top_p)
        if args.min_p is not None:
            plain = torch.softmax(logits, dim=-1)
            probs = probs * (plain >= plain.amax(dim=-1, keepdim=True) * args.min_p.unsqueeze(1))
        return probs


def _with_sampler(cls: type) -> type:
    class Planted(Engine):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.sampler = cls(self.sampler.device, self.sampler.vocab_size, seed=self.sampler.seed)

    Planted.__doc__ = f"This engine with its sampler's rule changed: {cls.__doc__}"
    return Planted


TopPOfFullMass = _with_sampler(_TopPOfFullMass)
MinPUntempered = _with_sampler(_MinPUntempered)


class PlantedOProj(Engine):
    """This engine with layer 1's attention output projection scaled by 1.02 (the resolution's 2% weight fault)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        with torch.no_grad():
            dict(self.model.named_parameters())["model.layers.1.self_attn.o_proj.weight"].mul_(1.02)


class DrawnPerProcess(Engine):
    """This engine with every projection's rows past 256 scaled by a factor drawn once per process in [1.02, 1.03),
    as a kernel tuned once at start-up would: the verdict is the same in every process (a miss beyond tolerance) but
    the bits differ from one process to the next (harness.parity.rerun must say so). An address-dependent plant
    would fail only in the processes whose allocator happened to lay the activations out one way."""

    FACTOR = 1.02 + 0.01 * int.from_bytes(os.urandom(3), "little") / 2 ** 24

    def __init__(self, config) -> None:
        super().__init__(config)
        ops = next(m.ops for m in self.model.modules() if hasattr(m, "ops"))
        plain = ops.linear

        def linear(x, weight, bias=None, act=None):
            out = plain(x, weight, bias, act)
            if x.shape[0] > 256:
                out[256:] *= self.FACTOR
            return out

        ops.linear = linear


EXTRA_PASSES = 3


class SlowForward(Engine):
    """This engine computing every forward 1 + EXTRA_PASSES times (the extra passes write the same K/V the last one
    writes again): four times the work, which a loaded host stretches as much as the work of the engine it is compared
    with (a fixed sleep would shrink against it)."""

    def forward_batch(self, batch, args):
        batch.out_loc = batch.out_loc.long()  # as forward_batch's own pass takes the KV slots
        for _ in range(EXTRA_PASSES):
            with self.ctx.forward_batch(batch):
                self.model.forward()
        return super().forward_batch(batch, args)
