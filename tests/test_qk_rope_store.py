"""The fused q/k norm + RoPE + KV store (engine/kernels/qk_rope_store.py) against a float64 definition: hypothesis
searches token counts, head counts, head dims, page sizes, norms, positions and slots (on the CPU through Triton's
interpreter). q and the stored K within the kernel's two roundings, V bit for bit, the projection's K left as the pool
got it (the ragged prefill reads it there), and every slot, layer and input it must leave alone bitwise as it was; a
token's result bit for bit the same in a batch of any size (a graph's padding, a prefill bucket); a planted one-position
shift is out of bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import qk_rope_store as fused
from engine.kvcache import KVCachePool
from engine.utils.device import has_triton
from engine.layers.rotary import cos_sin_table
from engine.models.config import RotaryConfig

pytestmark = [pytest.mark.skipif(not has_triton(), reason="needs Triton"), pytest.mark.devices]
MAX_POSITION, EPS, LAYER = 512, 1e-6, 1
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def _cases(draw):
    hkv = draw(st.sampled_from([1, 2, 4]))
    return dict(n=draw(st.integers(1, 3 * fused.BLOCK_T + 2)), hq=hkv * draw(st.sampled_from([1, 2, 4])), hkv=hkv,
                d=draw(st.sampled_from([64, 128, 256])), page_size=draw(st.sampled_from([1, 4, 16])),
                norm=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


def _inputs(n: int, hq: int, hkv: int, d: int, page_size: int, norm: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-2 * n // page_size) + 1
    pool = KVCachePool(2, num_pages, page_size, hkv, d, torch.device(DEVICE), torch.bfloat16)
    pool._kv.copy_(torch.randn(pool._kv.shape, generator=gen))  # what must survive where nothing is written
    table = cos_sin_table(RotaryConfig(d, MAX_POSITION, 1e6, None), MAX_POSITION).to(torch.bfloat16)
    return {"qkv": (2 * torch.randn(n, (hq + 2 * hkv) * d, generator=gen)).to(torch.bfloat16).to(DEVICE),
            "positions": torch.randint(0, MAX_POSITION, (n,), generator=gen, dtype=torch.int32).to(DEVICE),
            "out_loc": torch.randperm(num_pages * page_size - page_size, generator=gen)[:n].to(DEVICE),
            "weights": [(1 + 0.2 * torch.randn(d, generator=gen)).to(torch.bfloat16).to(DEVICE)
                        for _ in range(2)] if norm else [None, None],
            "table": table.float().to(DEVICE), "pool": pool, "heads": (hq, hkv, d)}


def _views(inp: dict, qkv: torch.Tensor) -> tuple:
    hq, hkv, d = inp["heads"]
    return qkv[:, : hq * d].view(-1, hq, d), qkv[:, hq * d:].view(-1, 2, hkv, d)


def _run(inp: dict, shift: int = 0) -> tuple:
    """The kernel on copies -> (q after it, the pool after it, the merged projection's K and V after it)."""
    qkv, pool = inp["qkv"].clone(), inp["pool"]
    saved = pool._kv.clone()
    q, kv = _views(inp, qkv)
    fused.qk_rope_store(inp["positions"] + shift, q, kv, inp["table"], *inp["weights"], EPS, *pool.slots(LAYER),
                        inp["out_loc"])
    after = pool._kv.clone()
    pool._kv.copy_(saved)
    return q, after, kv


def _exact(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """float64 norm and rotation of x [N, H, D] -> (the result, a bound on the kernel's error: one bf16 unit (2^-8
    relative, a truncating cast's full unit on the interpreter) of the normed halves it rounds and of the output)."""
    h = x.double()
    if weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    x1, x2 = h.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    rounded_in = 0.0 if weight is None else torch.cat([(x1 * cos).abs() + (x2 * sin).abs(),
                                                       (x2 * cos).abs() + (x1 * sin).abs()], dim=-1)
    return out, 2.0 ** -7 * (rounded_in + out.abs()) + 1e-6


def _errors(inp: dict, q: torch.Tensor, pool_after: torch.Tensor, kv_after: torch.Tensor) -> list:
    """What is out of bounds or touched that must not be, as messages (empty: all good)."""
    hq, hkv, d = inp["heads"]
    q0, kv0 = _views(inp, inp["qkv"])
    cos, sin = inp["table"].double()[inp["positions"].long()][:, None].chunk(2, dim=-1)
    loc = inp["out_loc"]
    k_pool, v_pool = pool_after[0, LAYER].view(-1, hkv, d), pool_after[1, LAYER].view(-1, hkv, d)
    bad = []
    for name, got, x, w in (("q", q, q0, inp["weights"][0]), ("k", k_pool[loc], kv0[:, 0], inp["weights"][1])):
        want, bound = _exact(x, w, cos, sin)
        err = (got.double() - want).abs()
        if not (err <= bound).all():
            worst = int((err / bound).argmax())
            bad.append(f"{name}: error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}")
    if not torch.equal(v_pool[loc], kv0[:, 1]):
        bad.append("V not stored bit for bit")
    if not torch.equal(kv_after[:, 1], kv0[:, 1]):
        bad.append("the projection's V changed")
    if not torch.equal(kv_after[:, 0], k_pool[loc]):
        bad.append("the projection's K is not left as the pool got it")
    untouched = torch.ones(pool_after.shape[0:2] + (k_pool.shape[0],), dtype=torch.bool, device=loc.device)
    untouched[:, LAYER, loc] = False
    before = inp["pool"]._kv.view(2, 2, -1, hkv, d)
    if not torch.equal(pool_after.view(2, 2, -1, hkv, d)[untouched], before[untouched]):
        bad.append("a slot it does not own changed")
    return bad


@settings(max_examples=20, deadline=None)
@given(case=_cases())
def test_kernel_matches_float64(case):
    inp = _inputs(**case)
    assert not _errors(inp, *_run(inp)), _errors(inp, *_run(inp))


@settings(max_examples=10, deadline=None)
@given(case=_cases(), data=st.data())
def test_a_tokens_result_does_not_depend_on_its_batch(case, data):
    """The first k tokens alone give the bits they get among all n (tiles cut at other tokens, masked rows)."""
    inp = _inputs(**case)
    k = data.draw(st.integers(1, case["n"]))
    q_all, pool_all, _ = _run(inp)
    part = dict(inp, qkv=inp["qkv"][:k], positions=inp["positions"][:k], out_loc=inp["out_loc"][:k])
    q_part, pool_part, _ = _run(part)
    assert torch.equal(q_part, q_all[:k])
    hkv, d = inp["heads"][1:]
    loc = inp["out_loc"][:k]
    assert torch.equal(pool_part.view(2, 2, -1, hkv, d)[:, LAYER, loc], pool_all.view(2, 2, -1, hkv, d)[:, LAYER, loc])


def test_a_one_position_shift_is_out_of_bounds():
    """The check has teeth: RoPE at position p + 1 (what a decode off by one does) fails it, for q and for K."""
    inp = _inputs(n=6, hq=4, hkv=2, d=128, page_size=4, norm=True, seed=1)
    inp["positions"].clamp_(max=MAX_POSITION - 2)
    assert not _errors(inp, *_run(inp))
    bad = _errors(inp, *_run(inp, shift=1))
    assert any(b.startswith("q:") for b in bad) and any(b.startswith("k:") for b in bad), bad
