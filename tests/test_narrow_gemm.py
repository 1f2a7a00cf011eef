"""The narrow GEMM (engine/kernels/narrow_gemm.py, a CUTLASS kernel built on first use on sm90): against a float64
product within twice cuBLAS's error, rows independent of M (what graph padding and prefill buckets rely on), a
chain of them under programmatic dependent launch in a CUDA graph equal to the same chain eagerly, and the fused ops'
dispatch. On the CPU: the shapes it takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from engine.kernels import narrow_gemm as ng


@given(m=st.integers(-2, 300), n=st.integers(0, 5000), k=st.integers(0, 5000))
def test_takes_narrow_aligned_shapes_up_to_max_rows(m, n, k):
    assert ng.takes(m, n, k) == (1 <= m <= ng.MAX_ROWS and n <= k and n % 8 == 0 and k % 8 == 0)


def _available() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and ng._library() is not None)


needs_kernel = pytest.mark.skipif(torch.cuda.is_available() and not _available(),
                                  reason="no sm90 GPU, nvcc or CUTLASS headers: cuBLAS serves")


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=gen).cuda().bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).cuda().bfloat16()
    return x, w


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (256, 256), (256, 512), (256, 1024), (640, 2048),
                                 (8, 64)])
@pytest.mark.parametrize("m", [1, 5, 17, 64, 100, 128, 200, 256])
def test_matches_float64_within_twice_cublas(m, n, k):
    x, w = _operands(m, n, k, seed=m * 7 + n)
    ref = F.linear(x.double(), w.double())
    err = (ng.narrow_gemm(x, w).double() - ref).abs().max().item()
    cublas = (F.linear(x, w).double() - ref).abs().max().item()
    assert err <= 2 * cublas + 1e-6, f"M={m} N={n} K={k}: error {err:.3g} against cuBLAS's {cublas:.3g}"


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("n,k", [(1024, 2048), (256, 512)])
def test_rows_do_not_depend_on_the_row_count(n, k):
    """A prompt's eager forward (M = its tokens) and its prefill graph (M = the bucket), or a decode batch and the
    graph it pads to, give its rows the same bits."""
    x, w = _operands(256, n, k, seed=11)
    for bucket in (128, 256):
        full = ng.narrow_gemm(x[:bucket], w)
        for m in (1, 17, 64, 100, bucket - 1):
            assert torch.equal(ng.narrow_gemm(x[:m], w), full[:m]), f"rows of M={m} differ within M={bucket}"


@pytest.mark.cuda
@needs_kernel
def test_a_chain_under_programmatic_launch_in_a_graph_equals_eager():
    """Each call reads the one before it: a call that loaded its input before waiting on the kernel that writes it
    would read the previous replay's values, which the new input makes differ."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    sizes = (2048, 1024, 512, 256)
    ws = [(torch.randn(o, i, generator=gen) / i ** 0.5).cuda().bfloat16() for i, o in zip(sizes, sizes[1:])]
    x = torch.empty(128, sizes[0], device="cuda", dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        y = x
        for w in ws:
            y = ng.narrow_gemm(y, w)
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.normal_()
        chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = chain()
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=gen).cuda().bfloat16())
        graph.replay()
        assert torch.equal(out, chain()), f"replay {seed}"


@pytest.mark.cuda
@needs_kernel
def test_fused_ops_take_narrow_projections_of_up_to_max_rows():
    """ops.linear: the narrow GEMM for N <= K from 17 rows (fewer: the skinny GEMM where it has a configuration) up to
    MAX_ROWS, the gated activation formed first; cuBLAS for wide weights, more rows, or a bias."""
    from engine.layers.ops import FlashInferOps

    pytest.importorskip("flashinfer")
    ops = FlashInferOps()
    x, w = _operands(ng.MAX_ROWS + 8, 1024, 3072, seed=2)
    for m in (17, 64, ng.MAX_ROWS):
        assert torch.equal(ops.linear(x[:m], w), ng.narrow_gemm(x[:m], w))
    assert torch.equal(ops.linear(x, w), F.linear(x, w))  # past MAX_ROWS
    gate_up = torch.randn(64, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(ops.linear(gate_up, w, act="silu"), ng.narrow_gemm(ops.act_and_mul(gate_up, "silu"), w))
    wide, x_wide = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16), x[:64, :1024].contiguous()
    assert torch.equal(ops.linear(x_wide, wide), F.linear(x_wide, wide))
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(ops.linear(x[:64], w, bias), F.linear(x[:64], w, bias))
