"""The CPU's fp32 kernels, built on first use with the system's C++ compiler into one library: paged attention
(cpu_attention.cpp) and the layer's small ops (cpu_ops.cpp: RoPE in place, the gated activation, RMSNorm and the
residual's add before it).

Attention, why: torch's CPU attention needs the keys as one tensor, so a batch over the paged pool first gathers
every request's K and V into a padded copy and attends it under a mask tensor (the decode step at batch 32 spent 29%
of its time there), and its fused kernel reaches about 40 GFLOP/s on a core of the AMD EPYC host at a 512-token
prompt. This kernel reads the keys in place through the page table, visits only the key blocks a query block can see
(causal and sliding window), and runs its inner products and online softmax in 16-lane vectors: across a block's
rows for prompts, across D and then across keys for a decode's few rows. On the 2-core AMD EPYC host, one layer of
SmolLM2 (9 query heads, 3 KV heads, head_dim 64), 2 threads: a 512-token prompt 2.2 ms against SDPA's 4.1, 2048
tokens 33 against 40, a decode step of 32 requests at 150 keys 0.18 ms with its keys in cache and 0.56 without,
against about 1 for the gather and SDPA (docs/perf-log.md, 2026-12-07).

The small ops, why: torch composes RoPE of eight passes (the rotation's products, sums and concatenation, a copy
back), RMSNorm of five and the activation of two, each allocating its result; these take one pass (two for a norm:
the sum of squares, then the scaling), in place for RoPE and for the residual's add and norm. A 512-token prefill of
SmolLM2 spent 21 ms a step in rotary, 21 in norms and 23 in the activation, where vLLM's CPU build spends about 2, 8
and 11 (its fused C++ kernels); now 4, 7 and 12.

Numerics: fp32 throughout; the exponential (the softmax's, silu's, gelu's tanh) a polynomial within about 1 ulp; the
compiler fuses a product and a sum into one rounding where it can. A query's attention depends only on its own keys
and its request's query count in the step (which picks the layout), not on the thread count or the other requests of
its batch; an op's row only on that row. Checked against float64 references by tests/test_cpu_kernels.py.

Build: `c++` (or $CXX) with -O3 -march=native -fopenmp into ENGINE_CACHE_DIR (default ~/.cache/engine-harness),
under a name hashed from the sources, the flags, the compiler's version and the CPU's model, once per machine (about
ten seconds). OpenMP: the library links libgomp, which torch has already loaded, so the kernels' threads are
torch's, as many as torch.get_num_threads(). Without a compiler, or where the build fails, torch's attention and ops
serve (logged once).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_attention.cpp", "cpu_ops.cpp", "cpu_vec.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)  # a kernel each (cpu_attention.cpp's switch)
MAX_GROUP = 64  # query heads a KV head serves


def available(head_dim: int | None = None, group: int = 1) -> bool:
    """Whether the library loads on this machine (building it first where the cache has none), and where head_dim
    is given, whether its attention serves that head size with `group` query heads to a KV head."""
    return (head_dim is None or (head_dim in HEAD_DIMS and group <= MAX_GROUP)) and _library() is not None


def attend(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, page_table: torch.Tensor,
           reqs: torch.Tensor, window: int | None, scale: float, out: torch.Tensor) -> None:
    """out [N, Hq * D] <- attention of q [N, Hq, D] (a view: its heads' rows contiguous) over the pool's K and V
    [slots, Hkv, D] of each request: reqs [B, 4] int64 rows (first query row, queries, page-table row, cached keys);
    a query at position p sees the keys at positions <= p (and > p - window on a sliding layer)."""
    n, hq, d = q.shape
    assert q.dtype == k_slots.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == d
    assert k_slots.is_contiguous() and v_slots.is_contiguous() and out.is_contiguous() and reqs.is_contiguous()
    assert page_table.dtype == torch.int32 and page_table.stride(1) == 1 and reqs.dtype == torch.int64
    rc = _library().cpu_attention(q.data_ptr(), q.stride(0), k_slots.data_ptr(), v_slots.data_ptr(),
                                  k_slots.stride(0), page_table.data_ptr(), page_table.stride(0), reqs.data_ptr(),
                                  reqs.shape[0], hq, k_slots.shape[1], d, window or 0, scale, out.data_ptr(),
                                  torch.get_num_threads())
    if rc:
        raise RuntimeError(f"cpu_attention has no kernel for head_dim {d} with {hq} query heads to "
                           f"{k_slots.shape[1]} KV heads")


def rope_(positions: torch.Tensor, x: torch.Tensor, table: torch.Tensor) -> None:
    """Rotate-half RoPE of x [N, H, D] (a view: its heads' rows contiguous) in place; table [max_pos, D] fp32 holds
    cos | sin of the D / 2 frequencies."""
    n, heads, d = x.shape
    assert x.dtype == table.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == d
    assert table.is_contiguous() and table.shape[1] == d
    positions = positions.to(torch.int32).contiguous()
    _library().cpu_rope(x.data_ptr(), n, heads, x.stride(0), d, table.data_ptr(), positions.data_ptr(),
                        torch.get_num_threads())


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """[N, 2I] (gate | up, rows contiguous) -> act(gate) * up [N, I]; act: silu, else gelu's tanh approximation (as
    TorchOps.act_and_mul reads it)."""
    n, width = gate_up.shape
    assert gate_up.dtype == torch.float32 and gate_up.stride(1) == 1
    out = gate_up.new_empty(n, width // 2)
    _library().cpu_act_and_mul(gate_up.data_ptr(), out.data_ptr(), n, width // 2, gate_up.stride(0),
                               int(act != "silu"), torch.get_num_threads())
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, out: torch.Tensor | None = None
            ) -> torch.Tensor:
    """x [N, D] or [N, H, D] (a view: rows of D contiguous, heads D apart) -> x / rms(x) * (offset + weight), into out
    (a new [N, D] or [N, H, D] tensor, or x itself: in place)."""
    rows, heads, dim = (x.shape[0], 1, x.shape[1]) if x.dim() == 2 else x.shape
    assert x.dtype == weight.dtype == torch.float32 and x.stride(-1) == 1 and (heads == 1 or x.stride(1) == dim)
    out = torch.empty(x.shape) if out is None else out
    assert out.stride(-1) == 1 and (heads == 1 or out.stride(1) == dim) and weight.is_contiguous()
    _library().cpu_rmsnorm(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows, heads, dim,
                           weight.data_ptr(), eps, offset, torch.get_num_threads())
    return out


def add_rmsnorm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
    """In place, both [N, D] contiguous: residual += x, then x = rmsnorm(residual)."""
    assert x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
    assert x.dtype == residual.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
    _library().cpu_add_rmsnorm(x.data_ptr(), residual.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps,
                               offset, torch.get_num_threads())


def _cpu_model() -> str:
    """The CPU's model and instruction-set flags (-march=native builds for them), as /proc/cpuinfo states them."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "".join(lines) or platform.processor()


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, loaded (built first where the cache has none); None, logged once, where it cannot be."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        logger.info("CPU kernels off (torch's attention and ops instead): no C++ compiler")
        return None
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode() + (version + _cpu_model()).encode()
    cache = Path(os.environ.get("ENGINE_CACHE_DIR", Path.home() / ".cache" / "engine-harness"))
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"cpu_kernels-{hashlib.sha256(key).hexdigest()[:16]}.so"
    with open(cache / "cpu_kernels.lock", "w") as lock:  # one build at a time (parallel tests)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists() and not _build(cxx, target):
            return None
    lib = ctypes.CDLL(str(target))
    lib.cpu_attention.restype = ctypes.c_int
    lib.cpu_attention.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64]
                                  + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int] * 5
                                  + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    lib.cpu_rope.restype = None
    lib.cpu_rope.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.cpu_act_and_mul.restype = None
    lib.cpu_act_and_mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.cpu_rmsnorm.restype = None
    lib.cpu_rmsnorm.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_int64] * 3
                                + [ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_int])
    lib.cpu_add_rmsnorm.restype = None
    lib.cpu_add_rmsnorm.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
                                    + [ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_int])
    return lib


def _build(cxx: str, target: Path) -> bool:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        sources = [str(p) for p in SOURCES if p.suffix == ".cpp"]
        done = subprocess.run([cxx, *FLAGS, "-o", str(out), *sources], capture_output=True, text=True)
        if done.returncode != 0:
            logger.warning("CPU kernels' build failed (torch's attention and ops instead): %s", done.stderr[-2000:])
            return False
        os.replace(out, target)
    logger.info("built the CPU kernels into %s in %.1f s", target, time.perf_counter() - t0)
    return True
