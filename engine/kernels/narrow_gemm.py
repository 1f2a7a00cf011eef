"""y = x W^T on the narrow projections (N <= K: attention's output projection, the MLP's down projection) for up to 128
rows (a decode batch past the skinny GEMM's rows, a prompt of up to 128 tokens), on sm90, through a CUTLASS kernel
built on first use (narrow_gemm.cu).

Why: at these shapes a GEMM is a few microseconds of fixed cost. cuBLAS covers N = 1024 with few output tiles, so it
splits K and adds a reduction kernel, and it cannot launch under programmatic dependent launch (PDL), so each call's
launch and prologue wait for the kernel before it to end. This kernel takes 64 x 32 output tiles (enough CTAs without
splitting K) and launches under PDL: it sets up while the previous kernel finishes and waits on it before its first
load. On the H200, 28 calls on distinct weights in one CUDA graph, us a call against cuBLAS (F.linear): o_proj (N
1024, K 2048) at M = 64 / 128 / 256 4.53 / 4.64 / 5.59 against 6.08 / 6.24 / 6.63, down (N 1024, K 3072) 5.62 / 5.79
/ 7.03 against 8.09 / 8.31 / 7.84; at M = 512 cuBLAS is faster, and on the wide projections (qkv, gate_up) no
CUTLASS configuration measured beat it at every M up to 256. In the engine (`python -m harness bench --against`, one
H200) up to 256 rows the decode step at bs 64 measured 4.3% faster and at bs 256 0.4% slower, hence 128 rows (README,
"What the narrow GEMM changed").

A row's result depends only on its own inputs: every output tile sums K in the same 128-wide steps whatever M is, so
a prompt's eager forward (M = its tokens) and its prefill graph (M = the bucket) agree bit for bit, as do an eager
decode batch and the graph it pads to; the limit of 128 rows is a bucket and a decode graph size, so both sides of a
pair choose the same kernel.

Build: nvcc (on PATH, or under CUDA_HOME) and CUTLASS's headers, which FlashInfer's package ships, compile
narrow_gemm.cu for sm_90a into ENGINE_CACHE_DIR (default ~/.cache/engine-harness), under a name hashed from the
source, the flags and nvcc's version, once per machine (about a minute). Without either, or on another GPU, cuBLAS
serves every call (logged once). Checked against a float64 product, within twice the error of cuBLAS (F.linear,
the torch reference), by tests/test_narrow_gemm.py.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine.utils.device import programmatic_launch, sm_count

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("narrow_gemm.cu")
MAX_ROWS = 128
FLAGS = ("-O3", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-DCUTLASS_ENABLE_GDC_FOR_SM90=1",
         "-DNDEBUG", "-w", "-shared", "-Xcompiler", "-fPIC")


def takes(m: int, n: int, k: int) -> bool:
    """The shapes the kernel serves: 1..MAX_ROWS rows, a narrow weight (N <= K), both sizes multiples of 8 (TMA
    moves 16-byte aligned rows)."""
    return 0 < m <= MAX_ROWS and n <= k and n % 8 == 0 and k % 8 == 0


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str | None = None) -> bool:
    """Whether narrow_gemm takes x @ weight^T: no bias, bf16, a contiguous weight and x (K columns, or 2K: gate | up,
    whose activation the caller forms first), 16-byte aligned, on an sm90 GPU where the kernel is built."""
    n, k = weight.shape
    return (bias is None and x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype == torch.bfloat16
            and takes(x.shape[0], n, k) and x.shape[1] == (2 * k if act else k)
            and (act is not None or x.is_contiguous()) and weight.is_contiguous()
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0 and _sm90(_index(x))
            and _library() is not None)


def narrow_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in bf16 (fp32 accumulation, one rounding); see `supports`."""
    m, (n, k) = x.shape[0], weight.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    index = _index(x)
    sms = sm_count(index)
    lib = _library()
    _check_no_workspace(m, n, k, sms)
    rc = lib.narrow_gemm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, sms, None,
                         torch.cuda.current_stream(x.device).cuda_stream, int(programmatic_launch(index)))
    if rc:
        raise RuntimeError(f"narrow_gemm failed ({rc}: 1 not implemented, 2 initialisation, 3 launch) at M {m}, "
                           f"N {n}, K {k}")
    return y


@functools.cache
def _check_no_workspace(m: int, n: int, k: int, sms: int) -> None:
    """Once a shape: the kernel is called without a workspace, which its persistent schedule never asks for."""
    assert _library().narrow_gemm_workspace(m, n, k, sms) == 0, "the persistent schedule needs no workspace"


def _index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else None


def _cutlass() -> Path | None:
    """CUTLASS's root as FlashInfer's package ships it (include/ and tools/util/include/)."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "data" / "cutlass"
    return root if (root / "include" / "cutlass" / "cutlass.h").exists() else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, loaded (built first where the cache has none); None, logged once, where it cannot be."""
    nvcc, cutlass = _nvcc(), _cutlass()
    if nvcc is None or cutlass is None:
        logger.info("narrow GEMM off (cuBLAS instead): %s", "no nvcc" if nvcc is None else
                    "no CUTLASS headers (FlashInfer's package ships them)")
        return None
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ENGINE_CACHE_DIR", Path.home() / ".cache" / "engine-harness"))
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"narrow_gemm-{digest}.so"
    with open(cache / "narrow_gemm.lock", "w") as lock:  # one build at a time (TP ranks, parallel tests)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists() and not _build(nvcc, cutlass, target):
            return None
    lib = ctypes.CDLL(str(target))
    lib.narrow_gemm_workspace.restype = ctypes.c_size_t
    lib.narrow_gemm_workspace.argtypes = [ctypes.c_int] * 4
    lib.narrow_gemm.restype = ctypes.c_int
    lib.narrow_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    return lib


def _build(nvcc: str, cutlass: Path, target: Path) -> bool:
    logger.info("building the narrow GEMM (CUTLASS, sm_90a) into %s: once per machine, about a minute", target)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [nvcc, *FLAGS, f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}", "-o",
               str(out), str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            logger.warning("narrow GEMM build failed (cuBLAS instead): %s", done.stderr[-2000:])
            return False
        os.replace(out, target)
    logger.info("built the narrow GEMM in %.0f s", time.perf_counter() - t0)
    return True
