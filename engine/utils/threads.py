"""CPU numerics, fixed once, so that the same inputs give the same bits whatever else runs on the machine and in
every process.

A product's bits depend on how its work is split across threads (a 9-row decode GEMM computes rows 4-8 differently
at 1 and at 2 threads; docs/parity-determinism.md has the measurements). Two runtime features let that split follow
the machine's load: MKL's dynamic threading (MKL_DYNAMIC, on by default) may run a call on fewer threads than asked,
and OpenMP's (OMP_DYNAMIC; in libgomp the team shrinks by the load average) may start smaller teams. Both are
turned off here, and the thread count is set explicitly.

A product's bits may also follow the process: with its conditional numerical reproducibility (CNR) off, MKL is free
to take another kernel for the same GEMM from one run to the next (Intel documents run-to-run differences without
CNR, on its own CPUs). MKL_CBWR turns CNR on, in strict mode (a GEMM's bits also independent of the thread count); MKL
reads it when it first computes, so the engine package sets it when it is imported (engine/__init__.py) and an
engine checks, when it starts on a CPU, that MKL runs that way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import tempfile

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp, libiomp5 or libomp), found among this process's mappings."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libgomp", "libiomp5", "libomp")):
            return ctypes.CDLL(path)  # already loaded: this returns the same library, not a second copy
    return None


def fix_cpu_threads(threads: int) -> None:
    """threads for torch's pool, MKL and OpenMP, none of them free to use fewer under load. torch.set_num_threads
    also calls mkl_set_dynamic(false) (aten/src/ATen/ParallelOpenMP.cpp); OpenMP's dyn-var is set off here."""
    torch.set_num_threads(threads)
    omp = _openmp()
    if omp is None:
        logger.info("no OpenMP runtime found in this process: OMP_DYNAMIC left as the environment sets it")
        return
    omp.omp_set_dynamic(0)


def dynamic_threading() -> bool | None:
    """Whether OpenMP may start teams smaller than asked (None: no OpenMP runtime loaded)."""
    omp = _openmp()
    return None if omp is None else bool(omp.omp_get_dynamic())


MKL_CNR = "AUTO,STRICT"  # MKL_CBWR: the code branch MKL picks for this CPU, bitwise reproducible run to run


def mkl_cnr_mode() -> str | None:
    """The CNR mode MKL computes in, as its verbose line of one small GEMM states it ("AUTO,STRICT", or "OFF" where
    MKL computed before MKL_CBWR was set); None where torch has no MKL."""
    if not torch.backends.mkl.is_available():
        return None
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as captured:
        libc.fflush(None)
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)  # MKL writes its verbose lines to the C library's stdout
        try:
            with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                torch.nn.functional.linear(torch.ones(4, 64), torch.ones(8, 64))
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        found = re.search(r"CNR:(\S+)", captured.read().decode(errors="replace"))
    return found.group(1) if found else None


def check_mkl_cnr() -> str | None:
    """The CNR mode MKL computes in, with a warning where it is not the one the engine sets (MKL computed in this
    process before the engine package was imported, or MKL_CBWR says otherwise)."""
    mode = mkl_cnr_mode()
    if mode is not None and mode != MKL_CNR:
        logger.warning("MKL computes with conditional numerical reproducibility %s, not %s: the engine's bits may "
                       "differ from one process to the next. Import engine before running any torch operation, or "
                       "set MKL_CBWR=%s in the environment (docs/parity-determinism.md)", mode, MKL_CNR, MKL_CNR)
    return mode
