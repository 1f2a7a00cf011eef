"""CPU threading, fixed once, so that the same inputs give the same bits whatever else runs on the machine.

A product's bits depend on how its work is split across threads (a 9-row decode GEMM computes rows 4-8 differently
at 1 and at 2 threads; docs/parity-determinism.md has the measurements). Two runtime features let that split follow
the machine's load: MKL's dynamic threading (MKL_DYNAMIC, on by default) may run a call on fewer threads than asked,
and OpenMP's (OMP_DYNAMIC; in libgomp the team shrinks by the load average) may start smaller teams. Both are
turned off here, and the thread count is set explicitly: the numerics then depend on the thread count only.
"""

from __future__ import annotations

import ctypes
import functools
import logging

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
