"""The CPU's C++ kernels (engine/kernels/cpu_kernels.py) against float64 references, on batches hypothesis draws: paged
attention over any mix of prompts, chunks over a cached prefix and decodes (full and sliding layers, GQA, the head sizes
it serves, slots scattered over the pool; items of few rows, as a decode's, take their own layout), RoPE and the gated
activations. Each is held to the error of torch's own fp32 composition of the same op (SDPA, HF's RoPE, F.silu / F.gelu)
against the same reference, with a small margin; and a request's attention must not depend on its batch or the thread
count (bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler to build the CPU kernels")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, window: int | None,
               scale: float) -> torch.Tensor:
    """SDPA over [H, L, D] operands (any dtype) under HF's mask: key j visible to the query at qpos when j <= qpos and,
    on a sliding layer, qpos - j < window."""
    kpos = torch.arange(k.shape[1])[None, :]
    mask = kpos <= qpos[:, None]
    if window:
        mask &= qpos[:, None] - kpos < window
    g = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), attn_mask=mask,
                                          scale=scale)


@st.composite
def batches(draw):
    head_dim = draw(st.sampled_from(cpu_kernels.HEAD_DIMS))
    hkv = draw(st.sampled_from([1, 2, 3]))
    hq = hkv * draw(st.sampled_from([1, 2, 3, 4, 8]))
    queries = st.integers(1, 3) | st.integers(1, 200)  # few queries half the time: a decode's items
    reqs = draw(st.lists(st.tuples(st.integers(0, 300), queries), min_size=1, max_size=5))
    window = draw(st.sampled_from([None, 1, 7, 64, 100]))
    return head_dim, hq, hkv, reqs, window, draw(st.integers(0, 2**31 - 1))


def _attend(head_dim: int, hq: int, hkv: int, reqs: list, window: int | None, seed: int, threads: int = 2):
    """The kernel's output on a batch, with its operands: (out, q, k_pool, v_pool, table, rows)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(e for _, e in reqs)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)  # a view of the merged projection, as the engine's
    total = sum(c + e for c, e in reqs)
    pool = torch.randn(2, total + 5, hkv, head_dim, generator=gen)
    slots = torch.randperm(total + 5, generator=gen)[:total].to(torch.int32)
    table = torch.zeros(len(reqs) + 1, 512, dtype=torch.int32)
    rows, start, at = [], 0, 0
    for i, (cached, ext) in enumerate(reqs):
        table[i + 1, : cached + ext] = slots[at: at + cached + ext]
        rows.append([start, ext, i + 1, cached])
        start, at = start + ext, at + cached + ext
    out = torch.empty(tokens, hq * head_dim)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernels.attend(q, pool[0], pool[1], table, torch.tensor(rows, dtype=torch.int64), window,
                           head_dim ** -0.5, out)
    finally:
        torch.set_num_threads(saved)
    return out, q, pool, table, rows


@settings(max_examples=40, deadline=None)
@given(batches())
def test_attention_is_as_close_to_float64_as_sdpa(case):
    head_dim, hq, hkv, reqs, window, seed = case
    out, q, pool, table, rows = _attend(*case)
    scale = head_dim ** -0.5
    for start, ext, row, cached in rows:
        slots = table[row, : cached + ext].long()
        k, v = (pool[i][slots].transpose(0, 1) for i in (0, 1))  # [Hkv, L, D]
        qq = q[start: start + ext].transpose(0, 1)
        qpos = torch.arange(cached, cached + ext)
        exact = _reference(qq.double(), k.double(), v.double(), qpos, window, scale)
        sdpa = _reference(qq, k, v, qpos, window, scale)
        got = out[start: start + ext].view(ext, hq, head_dim).transpose(0, 1)
        sdpa_err = float((sdpa.double() - exact).abs().max())
        assert float((got.double() - exact).abs().max()) <= 2 * sdpa_err + 1e-6


@settings(max_examples=20, deadline=None)
@given(batches())
def test_a_requests_attention_depends_on_neither_its_batch_nor_the_threads(case):
    head_dim, hq, hkv, reqs, window, seed = case
    out, q, pool, table, rows = _attend(*case)
    one_thread, *_ = _attend(*case, threads=1)
    assert torch.equal(out, one_thread)
    for row in rows:  # each request as a batch of its own, over the same operands
        alone = torch.zeros_like(out)
        cpu_kernels.attend(q, pool[0], pool[1], table, torch.tensor([row], dtype=torch.int64), window,
                           head_dim ** -0.5, alone)
        start, ext = row[0], row[1]
        assert torch.equal(alone[start: start + ext], out[start: start + ext])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.sampled_from([(1, 2), (4, 16), (9, 64), (3, 256)]), st.integers(0, 2**31 - 1))
def test_rope_is_as_close_to_float64_as_hfs(tokens, shape, seed):
    heads, d = shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 3) * d, generator=gen)
    x = qkv[:, : heads * d].view(tokens, heads, d)
    freqs = torch.rand(d // 2, generator=gen, dtype=torch.float64)
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * freqs[None]
    table = torch.cat([angles.cos(), angles.sin()], -1).float()
    positions = torch.randint(0, 4096, (tokens,), generator=gen, dtype=torch.int32)

    def hf(x: torch.Tensor) -> torch.Tensor:
        cos, sin = table.to(x.dtype)[positions.long()].unsqueeze(1).chunk(2, dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    exact = hf(x.double())
    torch_err = float((hf(x).double() - exact).abs().max())
    cpu_kernels.rope_(positions, x, table)
    assert float((x.double() - exact).abs().max()) <= 2 * torch_err + 1e-7
    assert torch.equal(qkv[:, heads * d:], qkv[:, heads * d:].clone())  # nothing outside the view moved


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 70), st.sampled_from([1, 15, 16, 17, 100, 1536]), st.sampled_from(["silu", "gelu_pytorch_tanh"]),
       st.floats(0.1, 20.0), st.integers(0, 2**31 - 1))
def test_the_gated_activation_is_as_close_to_float64_as_torchs(rows, inter, act, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * spread

    def torch_act(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up

    exact = torch_act(gate_up.double())
    torch_err = float((torch_act(gate_up).double() - exact).abs().max())
    got = cpu_kernels.act_and_mul(gate_up, act)
    scale = float(exact.abs().max()) + 1.0
    assert float((got.double() - exact).abs().max()) <= 2 * torch_err + 4e-7 * scale


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 70), st.sampled_from([(1, 16), (1, 576), (1, 100), (4, 64), (3, 256)]),
       st.sampled_from([0.0, 1.0]), st.floats(0.01, 50.0), st.integers(0, 2**31 - 1))
def test_rmsnorm_and_its_residual_add_are_as_close_to_float64_as_hfs(rows, shape, offset, spread, seed):
    heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(dim, generator=gen)
    wide = torch.randn(rows, (heads + 2) * dim, generator=gen) * spread
    x = wide[:, : heads * dim].view(rows, heads, dim) if heads > 1 else wide[:, :dim]  # strided, as q and k are

    def hf(h: torch.Tensor) -> torch.Tensor:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h * (offset + weight.to(h.dtype)) if offset else weight.to(h.dtype) * h

    exact = hf(x.double())
    bound = 2 * float((hf(x).double() - exact).abs().max()) + 1e-6 * float(exact.abs().max())
    assert float((cpu_kernels.rmsnorm(x, weight, 1e-6, offset).double() - exact).abs().max()) <= bound
    cpu_kernels.rmsnorm(x, weight, 1e-6, offset, out=x)  # in place, leaving the rest of the row alone
    assert float((x.double() - exact).abs().max()) <= bound
    if heads == 1:
        y, residual = torch.randn(rows, dim, generator=gen) * spread, torch.randn(rows, dim, generator=gen)
        total = y + residual  # HF adds in the model dtype, then normalizes the sum
        exact = hf(total.double())
        bound = 2 * float((hf(total).double() - exact).abs().max()) + 1e-6 * float(exact.abs().max())
        cpu_kernels.add_rmsnorm_(y, residual, weight, 1e-6, offset)
        assert torch.equal(residual, total)
        assert float((y.double() - exact).abs().max()) <= bound
