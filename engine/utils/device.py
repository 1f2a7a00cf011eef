"""The device abstraction: streams, events, pinning and free memory on CUDA and on the CPU."""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import torch


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


class NullStream:
    """A CPU "stream": work runs synchronously on the calling thread."""

    def synchronize(self) -> None:
        pass


class NullEvent:
    """An "event" on a CPU: recording and waiting are no-ops (the work is done by the time record runs)."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def create_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device) if is_cuda(device) else NullStream()


def set_stream(stream: Any) -> None:
    """Make `stream` current for the engine's compute; None restores the default stream (a no-op on the CPU)."""
    if isinstance(stream, torch.cuda.Stream):
        torch.cuda.set_stream(stream)
    elif stream is None and torch.cuda.is_initialized():
        torch.cuda.set_stream(torch.cuda.default_stream())


def create_event(device: torch.device) -> Any:
    return torch.cuda.Event() if is_cuda(device) else NullEvent()


@functools.cache
def has_flashinfer() -> bool:
    """Whether FlashInfer (the CUDA kernels for attention, sampling filters and the small ops) is installed."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def has_triton() -> bool:
    """Whether Triton (the engine's own kernels: skinny GEMM, fused norms and RoPE, the sampler's draw) is installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pin(device: torch.device) -> bool:
    """Pinned host memory lets host-to-device copies run asynchronously; it only means something with CUDA."""
    return is_cuda(device)


def make_device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied asynchronously from pinned memory on CUDA (torch.tensor with
    pin_memory stores the list straight into a pinned allocation; `pinned` is the same for a numpy array)."""
    return torch.tensor(values, dtype=dtype, pin_memory=pin(device)).to(device, non_blocking=True)


def pinned(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array written straight into pinned memory when it is bound for a CUDA device (a copy from it runs
    asynchronously). Pinning a tensor after the fact (tensor.pin_memory()) asks the driver whether it is pinned
    first, which measured 0.1-0.5 ms a call on the H200's host."""
    host = torch.empty(array.shape, dtype=dtype, pin_memory=pin(device))
    host.numpy()[...] = array
    return host


def free_memory(device: torch.device) -> int:
    """Bytes free now: the GPU's free memory, or the host's available memory on a CPU."""
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def physical_cores() -> int:
    """Physical cores (hyper-threads share a core's FPU, so counting them slows small matmuls)."""
    cores = set()
    for cpu in range(os.cpu_count() or 1):
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                cores.add(f.read().strip())
        except OSError:
            return max(len(os.sched_getaffinity(0)), 1)
    usable = len(os.sched_getaffinity(0))
    return max(min(len(cores), usable), 1)


@functools.cache
def sm_count(index: int) -> int:
    """The CUDA device's multiprocessor count, asked once (get_device_properties builds a Python object a call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def programmatic_launch(index: int) -> bool:
    """Whether the engine's Triton kernels on this CUDA device launch with programmatic dependent launch (PDL, sm90
    and later): a kernel may start while the one before it finishes, doing what reads only constant data (a
    projection's weight) before it waits on the grid before it (gdc_wait). Off under Triton's interpreter, which has
    no grids to overlap."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9
