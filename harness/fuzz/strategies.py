"""Hypothesis strategies for engine configurations and workloads.

Hypothesis shrinks toward the first value of each sampled_from and the low end of each range, and its first example
is that simplest one, so the first value of each choice is the path users run: on CUDA bf16, FlashInfer, CUDA graphs,
overlap; pages of 4 (page_size 1 changes every decode's page counts, so it hides what depends on pages); the
smallest pool (requests wait for pages); no prefill budget to speak of.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List

from random import Random

from hypothesis import strategies as st

from harness.fuzz.case import (LONG_NEW, LONG_PROMPT, LONG_SEQ_LEN, MAX_NEW, MAX_PROMPT, MAX_REQUESTS, FuzzConfig,
                               RequestSpec, Workload)

MAX_SLOTS = 8
PAGE_SIZES = [4, 16, 1]
POOL_TOKENS = [64, 128, 512]  # 64: one request of MAX_PROMPT + MAX_NEW tokens fills most of it
# 16: prompts are admitted a few at a time and the longer ones prefilled in chunks; 5: chunks across pages of 4 and
# 16 that do not divide them; 1: one-token chunks (with the prompts of up to MAX_PROMPT tokens, long against these)
PREFILL_BUDGETS = [4096, 16, 5, 1]
# the long tier: page_size 1 first (a long prompt's pages then pass a block of 1024), pools that hold one long request
# or several, budgets that cut a long prompt into 1 to 38 chunks while the short requests decode
LONG_PAGE_SIZES = [1, 16, 4]
LONG_POOL_TOKENS = [LONG_SEQ_LEN, 2 * LONG_SEQ_LEN, 4 * LONG_SEQ_LEN]
LONG_PREFILL_BUDGETS = [4096, 256, 100, 37]
LONG_REQUESTS = 4
TEMPERATURES = [1.0, 0.7, 1.5]
TOP_KS = [2, 5, 50]
TOP_PS = [0.9, 0.5, 0.2]
MIN_PS = [0.05, 0.2]


def dtypes(device: str, dtype: str | None = None) -> List[str]:
    """The dtypes a run draws: the one asked for, else fp32 on a CPU, bf16 and fp32 on CUDA."""
    return [dtype] if dtype else ["bfloat16", "float32"] if device.startswith("cuda") else ["float32"]


@st.composite
def configs(draw: Callable, device: str, dtype: str | None = None, invariant: bool | None = None,
            long: bool = False, attention: str | None = None) -> FuzzConfig:
    """On a CPU graphs do not exist, batch-invariant mode is on or off, and out of it the attention is the paged
    kernel (cpu, with the CPU's default ops) or the torch reference; on CUDA FlashInfer (half precision only) or torch
    attention, graphs on or off (FlashInfer only), bf16 or fp32. invariant: batch-invariant mode always (True), never
    (False), or drawn (None; drawn after the rest, so that the searches of earlier seeds keep their configurations,
    and the CPU's backend after it). long: the long tier's pages, pools and budgets. attention: the CPU's backend
    (None: drawn), for a planted fault that lives in one."""
    cuda = device.startswith("cuda")
    dtype = draw(st.sampled_from(dtypes(device, dtype)))
    half = dtype in ("bfloat16", "float16")
    backend = draw(st.sampled_from(["flashinfer", "torch"])) if cuda and half else "torch"
    graphs = draw(st.sampled_from([True, False])) if backend == "flashinfer" else False
    slots = draw(st.integers(1, MAX_SLOTS if not long else LONG_REQUESTS))
    page_size = draw(st.sampled_from(LONG_PAGE_SIZES if long else PAGE_SIZES))
    pool = draw(st.sampled_from(LONG_POOL_TOKENS if long else POOL_TOKENS))
    budget = draw(st.sampled_from(LONG_PREFILL_BUDGETS if long else PREFILL_BUDGETS))
    config = FuzzConfig(dtype=dtype, attention_backend=backend, graphs=graphs, slots=slots, page_size=page_size,
                        pool_tokens=pool, max_prefill_tokens=budget, overlap=draw(st.sampled_from([True, False])),
                        **({"max_seq_len": LONG_SEQ_LEN} if long else {}))
    if invariant is None:  # the engine refuses batch-invariant mode on CUDA
        invariant = False if cuda else draw(st.booleans())
    if not cuda and not invariant:  # the CPU's paged kernel or the torch reference (drawn last, as invariant is)
        config = dataclasses.replace(config, attention_backend=attention or draw(st.sampled_from(["cpu", "torch"])))
    return dataclasses.replace(config, batch_invariant=invariant)


@st.composite
def _sampling(draw: Callable) -> dict:
    """greedy, or temperature with any mix of top-k, top-p and min_p; a seed of its own or the engine's stream."""
    kind = draw(st.sampled_from(["greedy", "temperature", "top_k", "top_p", "min_p", "all"]))
    if kind == "greedy":
        return {}
    out = dict(temperature=draw(st.sampled_from(TEMPERATURES)))
    if kind in ("top_k", "all"):
        out["top_k"] = draw(st.sampled_from(TOP_KS))
    if kind in ("top_p", "all"):
        out["top_p"] = draw(st.sampled_from(TOP_PS))
    if kind in ("min_p", "all"):
        out["min_p"] = draw(st.sampled_from(MIN_PS))
    return out


@st.composite
def _request(draw: Callable, vocab: int) -> tuple:
    """(shared, own tokens, the rest of a RequestSpec): the prompt opens with `shared` tokens of the previous
    request's prompt (a shared prefix), then its own tokens."""
    shared = draw(st.integers(0, MAX_PROMPT))
    own = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=MAX_PROMPT)))
    prefix = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)))  # as a fraction of the prompt
    seed = draw(st.one_of(st.none(), st.integers(0, 2 ** 31 - 1)))
    rest = dict(max_tokens=draw(st.integers(1, MAX_NEW)), seed=seed, ignore_eos=draw(st.booleans()),
                **draw(_sampling()))
    return shared, own, prefix, rest


@st.composite
def workloads(draw: Callable, vocab: int, long: bool = False) -> Workload:
    """1..MAX_REQUESTS requests in arrival order: prompts of 1..MAX_PROMPT tokens (across page boundaries at every
    page size), 1..MAX_NEW new tokens, cached prefixes, EOS ids planted among the tokens the requests sample.
    long: the long tier's (long_workloads)."""
    if long:
        return draw(long_workloads(vocab))
    raw = draw(st.lists(_request(vocab), min_size=1, max_size=MAX_REQUESTS))
    requests: List[RequestSpec] = []
    for shared, own, prefix, rest in raw:
        previous = requests[-1].prompt if requests else ()
        prompt = (previous[:shared] + own)[:MAX_PROMPT]
        requests.append(RequestSpec(prompt=prompt, prefix_len=int(prefix * len(prompt)), **rest))
    n = len(requests)
    eos = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, MAX_NEW - 1)), max_size=3, unique=True))
    return Workload(tuple(requests), tuple(eos))


@st.composite
def long_workloads(draw: Callable, vocab: int) -> Workload:
    """A long prompt of LONG_PROMPT tokens, with short requests before it (1..MAX_PROMPT prompt tokens, up to MAX_NEW
    new ones: they decode while it is prefilled in chunks) and requests after it, each short or a deep share of the
    prompt before it (from half of it to all of it) and a few tokens of its own; at most LONG_REQUESTS in all; cached
    prefixes up to most of a prompt; greedy or sampled; long prompts make 1..LONG_NEW new tokens. Prompt ids come from
    a drawn seed: a thousand drawn ids would be slow to draw and to shrink."""
    before = draw(st.integers(0, LONG_REQUESTS - 1))
    after = draw(st.integers(0, LONG_REQUESTS - 1 - before))
    prompts = [_ids(draw(st.integers(0, 2 ** 16)), draw(st.integers(1, MAX_PROMPT)), vocab) for _ in range(before)]
    prompts.append(_ids(draw(st.integers(0, 2 ** 16)), draw(st.integers(*LONG_PROMPT)), vocab))
    for _ in range(after):
        own = _ids(draw(st.integers(0, 2 ** 16)), draw(st.integers(1, MAX_PROMPT)), vocab)
        if draw(st.booleans()):  # a deep shared prefix
            previous = prompts[-1]
            own = (previous[: draw(st.integers(len(previous) // 2, len(previous)))] + own)[: LONG_PROMPT[1]]
        prompts.append(own)
    requests = []
    for prompt in prompts:
        prefix = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)))
        new = draw(st.integers(1, MAX_NEW if len(prompt) <= MAX_PROMPT else LONG_NEW))
        requests.append(RequestSpec(prompt=prompt, prefix_len=int(prefix * len(prompt)), max_tokens=new,
                                    ignore_eos=True, seed=draw(st.one_of(st.none(), st.integers(0, 2 ** 31 - 1))),
                                    **draw(_sampling())))
    return Workload(tuple(requests))


def _ids(seed: int, n: int, vocab: int) -> tuple:
    rng = Random(seed)
    return tuple(rng.randrange(vocab) for _ in range(n))
