"""Unit tests of engine.sample: the spec's test, repeated draws, prepare, greedy rows, seeds, bad input, the oracle."""

from __future__ import annotations

import math
from typing import List, Sequence

import numpy as np
import pytest
import torch

from engine.core import Batch, Req, SamplingParams
from engine.sample import Sampler, filtered_probs
from harness.sampling.cases import small_cases
from harness.sampling.oracle import filtered_distribution
from harness.sampling.run import make_batch

CPU = torch.device("cpu")
SPEC_LOGITS = [5.0, 4.0, 3.0, 0.0, 0.0, 0.0]


def draw(logits: torch.Tensor, params: Sequence[SamplingParams], reps: int, seed: int = 0) -> torch.Tensor:
    """reps draws per row in one call (the batch repeated) -> [reps, rows]."""
    sampler = Sampler(CPU, logits.shape[1], seed=seed)
    args = sampler.prepare(make_batch(list(params) * reps))
    return sampler.sample(logits.repeat(reps, 1), args).view(reps, len(params))


# ------------------------------------------------------------------------------------------ the spec's example
def _batch(params: List[SamplingParams]) -> Batch:
    """The spec's helper: one request per SamplingParams, built as its hand-driven example builds them."""
    reqs = [Req(input_ids=torch.tensor([1, 2, 3], dtype=torch.int32), table_idx=row, cached_len=0, output_len=8,
                uid=row, sampling_params=p, cache_handle=None) for row, p in enumerate(params)]
    return Batch(reqs=reqs, phase="prefill")


def test_sampler_greedy_and_filters():
    """The spec's test as it writes it: 2000 sample calls on the same args are 2000 draws."""
    sampler = Sampler(torch.device("cpu"), vocab_size=6)
    assert sampler.prepare(_batch([SamplingParams(), SamplingParams()])).temperatures is None
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0, 0.0]] * 3)
    args = sampler.prepare(_batch([SamplingParams(temperature=1.0, top_k=2),
                                   SamplingParams(temperature=1.0, top_p=0.5),
                                   SamplingParams()]))  # the third request is greedy
    torch.manual_seed(0)
    draws = torch.stack([sampler.sample(logits, args) for _ in range(2000)])
    assert set(draws[:, 0].tolist()) == {0, 1}  # top-k=2: only the top two are possible
    assert set(draws[:, 1].tolist()) == {0}  # the top probability is about 0.67 > 0.5, so top-p keeps only it
    assert set(draws[:, 2].tolist()) == {0}  # the greedy requests in a mixed batch
    p0 = (draws[:, 0] == 0).float().mean().item()  # renormalized after top-k: e^5/(e^5+e^4) = 0.731
    assert abs(p0 - 0.731) < 0.03


def test_the_first_draw_is_the_keyed_one_and_later_draws_are_fresh() -> None:
    """A request's token is what prepare's uniforms give, in any batch; further draws on the same args hash the
    draw index in, so they differ from the first and from each other, and repeat from run to run."""
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 0.5]] * 64)
    batch = make_batch([SamplingParams(1.0)] * 32 + [SamplingParams(1.0, seed=s) for s in range(32)])
    sampler = Sampler(CPU, 6, seed=3)
    args = sampler.prepare(batch)
    first, second, third = (sampler.sample(logits, args) for _ in range(3))
    again = sampler.prepare(batch)
    assert torch.equal(sampler.sample(logits, again), first) and args.draws == 3
    assert not torch.equal(first, second) and not torch.equal(second, third)
    assert torch.equal(sampler.sample(logits, again), second)  # the d-th draw is a function of (key, d)


def test_repeated_draws_on_one_args_are_independent() -> None:
    """Pairs (draw d, draw d + 1), d even, of 64 rows against the product of the oracle's marginals."""
    from harness.sampling.stats import chi_square

    row = np.array([1.0, 0.4, 0.0, -0.3, -1.0, 0.7])
    sampler = Sampler(CPU, 6)
    args = sampler.prepare(make_batch([SamplingParams(1.0)] * 64))
    logits = torch.from_numpy(row).float().repeat(64, 1)
    draws = torch.stack([sampler.sample(logits, args) for _ in range(200)]).numpy()
    p = filtered_distribution(row, 1.0).probs
    pairs = (draws[0::2] * 6 + draws[1::2]).ravel()
    assert chi_square(np.bincount(pairs, minlength=36), np.outer(p, p).ravel()).p_value > 1e-3
    assert chi_square(np.bincount(draws.ravel(), minlength=6), p).p_value > 1e-3


# ------------------------------------------------------------------------------------------ the oracle's numbers
def test_oracle_top_k_spec_number() -> None:
    probs = filtered_distribution(np.array(SPEC_LOGITS), 1.0, top_k=2).probs
    assert probs[0] == pytest.approx(math.exp(5) / (math.exp(5) + math.exp(4)))
    assert probs[0] == pytest.approx(0.731, abs=5e-4) and probs[2:].sum() == 0.0


def test_oracle_top_k_before_top_p_unlike_a_joint_filter() -> None:
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    assert filtered_distribution(logits, 1.0, top_k=2, top_p=0.5).probs.tolist() == [1.0, 0.0, 0.0, 0.0]
    joint = filtered_distribution(logits, 1.0, top_p=0.5).probs  # top-p on the whole distribution: mass ahead 0.4
    assert joint[:2] == pytest.approx([0.4 / 0.7, 0.3 / 0.7]) and joint[2:].sum() == 0.0


def test_oracle_tie_rules_and_invalid_rows() -> None:
    tie_k = filtered_distribution(np.array([0.0, 2.0, 1.0, 3.0, 1.0, 1.0]), 1.0, top_k=3).probs
    assert np.flatnonzero(tie_k).tolist() == [1, 2, 3, 4, 5]  # ids 2, 4, 5 tie with the 3rd: all stay
    quarter = filtered_distribution(np.array([-np.inf, 0.0, 0.0, 0.0, 0.0]), 1.0, top_p=0.5).probs
    assert np.flatnonzero(quarter).tolist() == [1, 2, 3, 4]  # the crossing token ties with two more: all stay
    half = filtered_distribution(np.log([0.125, 0.5, 0.25, 0.125]), 1.0, top_p=0.7).probs
    assert np.flatnonzero(half).tolist() == [1, 2]  # 0.5 + 0.25 reaches 0.7: the crossing token stays, no more
    assert filtered_distribution(np.array([1.0, 3.0, 3.0]), 0.0).probs.tolist() == [0.0, 1.0, 0.0]
    assert filtered_distribution(np.array([1.0, np.nan]), 1.0).probs is None
    assert filtered_distribution(np.array([-np.inf, -np.inf]), 1.0).probs is None


def test_filtered_probs_matches_oracle_on_every_small_case() -> None:
    """The deterministic half of the distribution tests: the sampler's probabilities against the float64 oracle."""
    for case in small_cases():
        sampler = Sampler(CPU, case.vocab)
        args = sampler.prepare(make_batch(case.params))
        if args.temperatures is None:
            continue
        logits = torch.from_numpy(case.logits)
        logits = torch.where(logits.amax(dim=-1, keepdim=True).isfinite(), logits, 0.0)  # as Sampler.sample does
        probs = filtered_probs(logits, args.temperatures, args.top_k, args.top_p, args.min_p).double()
        for i, p in enumerate(case.params):
            want = filtered_distribution(case.logits[i], p.temperature, p.top_k, p.top_p, p.min_p).probs
            if want is None or p.is_greedy:
                continue
            got = (probs[i] / probs[i].sum()).numpy()
            assert np.array_equal(got > 0, want > 0), f"{case.name} row {i}: support differs"
            np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"{case.name} row {i}")


# ------------------------------------------------------------------------------------------ prepare and greedy rows
def test_prepare_mixed_batch_layout() -> None:
    params = [SamplingParams(0.0), SamplingParams(0.7, top_k=50), SamplingParams(1.0)]
    args = Sampler(CPU, 100).prepare(make_batch(params))
    assert args.temperatures.tolist() == pytest.approx([1e-6, 0.7, 1.0])
    assert args.top_k.tolist() == [100, 50, 100]  # greedy rows are not limited by top-k: the argmax answers them
    assert args.top_p is None and args.min_p is None
    assert args.greedy.tolist() == [True, False, False]
    assert Sampler(CPU, 10).prepare(make_batch(params)).top_k is None  # 50 > vocab: no row is limited
    assert Sampler(CPU, 10).prepare(make_batch([SamplingParams(1.0, top_p=0.9)])).greedy is None


@pytest.mark.parametrize("logits, argmax", [([2.0, 3.0, 3.0, 0.5], 1),  # exact tie: the lower id, like argmax
                                            ([2.0, 3.0 - 2.0 ** -21, 1.0, 3.0], 3)])  # 5e-7 apart: T=1e-6 is not 0
def test_greedy_row_in_mixed_batch_is_the_argmax(logits: list, argmax: int) -> None:
    params = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.9, top_k=1)]
    draws = draw(torch.tensor([logits] * 3), params, reps=4000)
    assert set(draws[:, 0].tolist()) == {argmax} and set(draws[:, 2].tolist()) == {argmax}
    greedy_only = draw(torch.tensor([logits]), [SamplingParams(0.0)], reps=10)
    assert set(greedy_only[:, 0].tolist()) == {argmax}  # the all-greedy path answers the same


# ------------------------------------------------------------------------------------------ seeds and bad input
def test_same_seed_same_draws() -> None:
    logits = torch.tensor([SPEC_LOGITS, [0.0, 1.0, 2.0, 3.0, 2.0, 1.0]])
    params = [SamplingParams(1.0, top_p=0.9), SamplingParams(0.8, top_k=4, min_p=0.05)]
    first, again = draw(logits, params, 500, seed=7), draw(logits, params, 500, seed=7)
    assert torch.equal(first, again)
    assert not torch.equal(first, draw(logits, params, 500, seed=8))


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0},
                                    {"top_p": 1.5}, {"top_p": -0.2}, {"top_k": 0}, {"top_k": -2}, {"top_k": 2.5},
                                    {"min_p": -0.01}, {"min_p": 1.01}])
def test_invalid_sampling_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
@pytest.mark.parametrize("greedy", [False, True])
def test_bad_rows_give_minus_one_and_leave_the_others_alone(bad: float, greedy: bool) -> None:
    good = torch.tensor([1.0, -0.5, 3.0, 0.0, 2.2, -4.0, 2.5, 0.5])
    bad_row = torch.full_like(good, bad) if math.isinf(bad) else good.index_fill(0, torch.tensor([3]), bad)
    t = 0.0 if greedy else 1.0
    params = [SamplingParams(t), SamplingParams(t), SamplingParams(t, top_k=5), SamplingParams(t, top_p=0.9)]
    with_bad = draw(torch.stack([good, bad_row, good.flip(0), good * 0.5]), params, reps=500, seed=3)
    replaced = draw(torch.stack([good, good * 2, good.flip(0), good * 0.5]), params, reps=500, seed=3)
    assert set(with_bad[:, 1].tolist()) == {-1}
    # each row's draw depends on its own logits and uniform only
    assert torch.equal(with_bad[:, [0, 2, 3]], replaced[:, [0, 2, 3]])


# ------------------------------------------------------------------------------------------ ties, as HF keeps them
def test_issue_example_top_k_keeps_every_tied_token() -> None:
    """logits [3, 2, 2, 2, 1, 0], top_k 2: the 2nd largest ties with two more, so ids {0, 1, 2, 3} stay."""
    draws = draw(torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]]), [SamplingParams(1.0, top_k=2)], reps=4000)
    assert set(draws[:, 0].tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 6, 7])
def test_top_k_support_equals_hf_top_k_warper_at_ties(top_k: int) -> None:
    """The sampler, the oracle and HF's TopKLogitsWarper keep the same tokens when ties straddle k."""
    from transformers.generation.logits_process import TopKLogitsWarper

    gen = torch.Generator().manual_seed(top_k)
    for _ in range(20):
        logits = torch.randint(-3, 4, (1, 12), generator=gen).float()  # integer logits: ties everywhere
        hf = TopKLogitsWarper(top_k)(torch.zeros(1, 1, dtype=torch.long), logits.clone())[0] > -float("inf")
        oracle = filtered_distribution(logits[0].numpy(), 1.0, top_k=top_k).probs > 0
        if top_k == 1:  # greedy: HF keeps the tied maxima, the argmax answers with the lowest of them
            assert oracle.sum() == 1 and hf[int(np.flatnonzero(oracle)[0])]
            continue
        args = Sampler(CPU, 12).prepare(make_batch([SamplingParams(1.0, top_k=top_k)]))
        ours = filtered_probs(logits, args.temperatures, args.top_k, args.top_p)[0] > 0
        assert ours.tolist() == hf.tolist() == oracle.tolist(), logits


def test_top_p_keeps_the_crossing_tie_block_whatever_the_order() -> None:
    """Permuting the vocabulary permutes the kept set: no rule looks at the order of equal probabilities."""
    logits = torch.tensor([[2.0, 0.0, 2.0, 1.0, 2.0, -1.0, 0.5, 2.0]])
    params = [SamplingParams(1.0, top_p=0.5), SamplingParams(1.0, top_k=2, top_p=0.3)]
    for perm in (torch.arange(8), torch.tensor([7, 6, 5, 4, 3, 2, 1, 0]), torch.tensor([3, 0, 6, 1, 5, 2, 7, 4])):
        x = logits[:, perm].repeat(2, 1)
        args = Sampler(CPU, 8).prepare(make_batch(params))
        kept = filtered_probs(x, args.temperatures, args.top_k, args.top_p) > 0
        for row in kept:
            assert sorted(perm[row].tolist()) == [0, 2, 4, 7]


def test_a_requests_tokens_do_not_depend_on_its_batch() -> None:
    """A row's draw is a function of (seed, uid, position) and its logits: alone or among others, same tokens."""
    logits = torch.tensor([SPEC_LOGITS, [0.0, 1.0, 2.0, 3.0, 2.0, 1.0], [1.0] * 6])
    params = [SamplingParams(1.0), SamplingParams(0.8, top_k=4), SamplingParams(1.0, top_p=0.9)]
    sampler = Sampler(CPU, 6, seed=5)
    together = sampler.sample(logits, sampler.prepare(make_batch(params)))
    for i in range(3):
        batch = make_batch([params[i]])
        batch.reqs[0].uid = i
        assert sampler.sample(logits[i: i + 1], sampler.prepare(batch)).item() == together[i].item()


def test_request_seed_overrides_the_sampler_seed() -> None:
    logits = torch.tensor([[0.5, 1.0, 0.2, 0.9, 0.7, 0.1]] * 64)
    a = Sampler(CPU, 6, seed=1).prepare(make_batch([SamplingParams(1.0, seed=11)] * 64))
    b = Sampler(CPU, 6, seed=2).prepare(make_batch([SamplingParams(1.0, seed=11)] * 64))
    assert torch.equal(a.uniforms, b.uniforms)  # the request's seed, not the sampler's, keys its stream
    c = Sampler(CPU, 6, seed=1).prepare(make_batch([SamplingParams(1.0)] * 64))
    assert len(set(c.uniforms.tolist())) == 64  # without one, each uid has its own stream
    assert Sampler(CPU, 6).sample(logits, c).unique().numel() > 1
