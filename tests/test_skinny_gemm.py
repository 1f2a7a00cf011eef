"""The skinny GEMM (engine/kernels/skinny_gemm.py) against a float64 product: hypothesis searches shapes, bias and
configurations (on the CPU through Triton's interpreter); on the GPU also every configuration the tuner may pick, the
row independence that graph padding relies on, and the fused ops' dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import skinny_gemm as sg
from engine.utils.device import has_triton

pytestmark = [pytest.mark.skipif(not has_triton(), reason="needs Triton"), pytest.mark.devices]


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of the output dtype at |ref| (a rounding either way), plus fp32 accumulation's
    error: a few units of fp32 (2^-22) of sum |x| |w|, which cancellation leaves larger than |ref|."""
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - mant)
    return ulp + 2.0 ** -22 * F.linear(x.double().abs(), w.double().abs()) + 1e-30


def _check(m: int, n: int, k: int, bias: bool, config: sg.Config, device: str, dtype=torch.bfloat16,
           seed: int = 0) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    y = sg.skinny_gemm(x, w, b, config=config)
    assert y.shape == (m, n) and y.dtype == dtype
    err = (y.double() - ref).abs()
    bound = _bound(x, w, ref, dtype)
    worst = (err / bound).argmax()
    assert (err <= bound).all(), (f"M={m} N={n} K={k} bias={bias} {config}: error {err.flatten()[worst]:.3g} at "
                                  f"{divmod(int(worst), n)} > bound {bound.flatten()[worst]:.3g}")


@st.composite
def _cases(draw):
    m = draw(st.integers(1, sg.MAX_ROWS))
    k = draw(st.one_of(st.integers(1, 1100), st.sampled_from([128, 512, 576, 1024])))
    config = draw(st.sampled_from(sg.search_space(sg.block_m(m), k)))
    return m, draw(st.integers(1, 70)), k, draw(st.booleans()), config


@settings(max_examples=25, deadline=None)
@given(case=_cases(), seed=st.integers(0, 2 ** 16))
def test_kernel_matches_float64(case, seed):
    """On the GPU, or on the CPU through Triton's interpreter (conftest sets TRITON_INTERPRET without CUDA; its
    fp32 -> bf16 cast truncates, within the one-ulp bound)."""
    _check(*case, device="cuda" if torch.cuda.is_available() else "cpu", seed=seed)


def _act(g: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, sg.MAX_ROWS), n=st.integers(1, 40), k=st.integers(1, 700),
       act=st.sampled_from(["silu", "gelu_tanh"]), seed=st.integers(0, 2 ** 16), data=st.data())
def test_gated_activation_fused_in_matches_float64(m, n, k, act, seed, data):
    """x = gate | up [M, 2K]: the product of act(gate) * up, rounded once to bf16 as the activation kernel rounds it,
    within the GEMM's bound plus one bf16 unit of each activation value (a truncating cast on the interpreter)."""
    config = data.draw(st.sampled_from(sg.search_space(sg.block_m(m), k)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = (2 * torch.randn(m, 2 * k, generator=gen)).to(device, torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(device, torch.bfloat16)
    gate, up = x.double().chunk(2, dim=-1)
    a = _act(gate, act) * up
    ref = F.linear(a, w.double())
    y = sg.skinny_gemm(x, w, config=config, act=act)
    err = (y.double() - ref).abs()
    bound = _bound(a, w, ref, torch.bfloat16) + 2.0 ** -7 * F.linear(a.abs(), w.double().abs())
    assert (err <= bound).all(), f"M={m} N={n} K={k} {act} {config}: max error/bound {(err / bound).max():.3g}"


@given(bm=st.sampled_from([1, 2, 16]), k=st.integers(1, 1 << 14),
       bk=st.sampled_from([256, 512, 1024, 2048, 4096, 8192, 16384]))
def test_whole_k_tiles_cover_k_once(bm, k, bk):
    """At one row a step of bk >= K holds K as a power-of-two head and a tail rounded up to a power of two, which
    together cover K and fit in the step's width (the register budget `fits` counts); a narrower step, or more
    rows, walks K."""
    tiles = sg.whole_k(bm, k, bk)
    if bk < k or bm > 1:
        assert tiles is None
        return
    head, tail = tiles
    assert head & (head - 1) == 0 and tail & (tail - 1) == 0 and head <= k < 2 * head
    assert head + tail >= k and (tail == 0) == (k == head) and (tail == 0 or tail < 2 * (k - head))
    assert head + tail <= bk


def test_search_space_and_rule_fit_the_registers():
    for bm in (1, 2, 4, 8, 16):
        for k in (64, 576, 4096):
            space = sg.search_space(bm, k)
            assert space and all(sg.fits(bm, c) for c in space)
            for n in (128, 1024, 151936):
                assert sg.fits(bm, sg.default_config(bm, n, k, sms=132))


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (960, 576), (151936, 1024), (100, 70)])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_every_configuration_matches_float64(m, n, k):
    for config in sg.search_space(sg.block_m(m), k):
        _check(m, n, k, bias=n == 960, config=config, device="cuda", seed=m)


@pytest.mark.cuda
def test_rows_do_not_depend_on_the_padding_rows():
    """A decode batch padded to a graph size computes its real rows bit for bit as the unpadded batch."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    w = torch.randn(2048, 1024, generator=gen).cuda().bfloat16()
    x = torch.randn(16, 1024, generator=gen).cuda().bfloat16()
    for m, padded in ((3, 4), (5, 8), (9, 16)):
        assert torch.equal(sg.skinny_gemm(x[:m], w), sg.skinny_gemm(x[:padded], w)[:m])


@pytest.mark.cuda
def test_fused_ops_take_few_rows_where_the_table_or_rule_says_and_match_cublas():
    from engine.layers.ops import FlashInferOps

    pytest.importorskip("flashinfer")
    ops = FlashInferOps()
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    for m in (1, 4, 16, 17):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        config = sg.choose(x, w)
        measured = sg._table(torch.cuda.get_device_name()).get(f"{sg.block_m(m)},1024,512", "none")
        if m > sg.MAX_ROWS:
            assert config is None
        elif measured != "none":  # the device's table decides
            assert config == measured
        else:
            assert (config is not None) == (sg.block_m(m) <= sg.DEFAULT_MAX_BLOCK_M)
        expect = F.linear(x, w) if config is None else sg.skinny_gemm(x, w, config=config)
        assert torch.equal(ops.linear(x, w), expect)
        torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), atol=0.05, rtol=0.02)
    assert sg.choose(torch.randn(512, 4, device="cuda", dtype=torch.bfloat16).t(), w) is None  # K not unit-stride


@pytest.mark.cuda
def test_lm_head_takes_the_skinny_gemm_in_a_prefill_where_a_projection_does_not():
    """The LM head runs after the prefill graphs, on the batch's own rows in the eager and the graph forward alike, so
    in a prefill it takes the skinny GEMM as a decode does; a layer's projection there stays on cuBLAS (a prefill
    graph's M is its bucket, an eager prefill's its tokens)."""
    from engine.core import Batch, Context, set_global_ctx
    from engine.layers.ops import FlashInferOps

    pytest.importorskip("flashinfer")
    ops = FlashInferOps()
    w = torch.randn(32000, 1024, device="cuda", dtype=torch.bfloat16) / 32
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    config = sg.choose(x, w)
    assert config is not None  # no measured entry for this vocabulary: the rule takes one row
    ctx = Context(1)
    set_global_ctx(ctx)
    try:
        with ctx.forward_batch(Batch(reqs=[], phase="prefill")):
            assert torch.equal(ops.lm_head(x, w), sg.skinny_gemm(x, w, config=config))
            assert torch.equal(ops.linear(x, w), F.linear(x, w))
    finally:
        set_global_ctx(None)


@pytest.mark.cuda
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_ops_down_projection_with_the_activation_matches_the_unfused_pair(act):
    """ops.linear(gate | up, act=...) at 1 row (the activation inside the skinny GEMM) and at 3 (FlashInfer's
    activation kernel, then the GEMM) against FlashInfer's activation then cuBLAS."""
    from engine.layers.ops import FlashInferOps

    pytest.importorskip("flashinfer")
    ops = FlashInferOps()
    gen = torch.Generator(device="cpu").manual_seed(3)
    w = torch.randn(1024, 3072, generator=gen).cuda().bfloat16() / 3072 ** 0.5
    x = (2 * torch.randn(3, 2 * 3072, generator=gen)).cuda().bfloat16()
    for m in (1, 3):
        want = F.linear(ops.act_and_mul(x[:m], act), w)
        torch.testing.assert_close(ops.linear(x[:m], w, act=act), want, atol=0.02, rtol=0.02)
