"""Tensor-parallel rank info and the process groups (created only when TP > 1)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not (0 <= self.rank < self.size):
            raise ValueError(f"TP rank {self.rank} is not in [0, {self.size})")

    def is_primary(self) -> bool:
        return self.rank == 0


_TP_INFO: DistributedInfo | None = None
_TP_GROUP: dist.ProcessGroup | None = None  # gloo on CPU, NCCL on CUDA: carries the activations
_TP_CPU_GROUP: dist.ProcessGroup | None = None  # gloo: carries host-side agreement (memory sizes)


def set_tp_info(rank: int, size: int) -> None:
    global _TP_INFO
    _TP_INFO = DistributedInfo(rank, size)


def get_tp_info() -> DistributedInfo:
    assert _TP_INFO is not None, "TP info is set by Engine.__init__"
    return _TP_INFO


def init_process_groups(info: DistributedInfo, device: torch.device, addr: str, timeout_s: float) -> dist.ProcessGroup:
    """Join the TP world. A rank that never arrives makes the others fail after `timeout_s`, not hang."""
    global _TP_GROUP, _TP_CPU_GROUP
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process: shut the previous Engine down "
                           "(Engine.shutdown destroys its groups) before starting another with TP > 1")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=addr, rank=info.rank, world_size=info.size, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
    except Exception as e:  # torch's message is one line of cause followed by C++ frames
        cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(
            f"TP rank {info.rank} of {info.size} could not join the TP world at {addr} within "
            f"distributed_timeout={timeout_s:g} s: {type(e).__name__}: {cause} (every rank must be started, "
            "with the same distributed_port, and rank 0's port must be free)") from e
    _TP_GROUP = dist.group.WORLD
    _TP_CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else _TP_GROUP
    return _TP_CPU_GROUP


def destroy_process_groups() -> None:
    global _TP_GROUP, _TP_CPU_GROUP, _TP_INFO
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = _TP_CPU_GROUP = _TP_INFO = None


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_INFO is not None and _TP_INFO.size > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., size * n], rank-major (the vocab-parallel LM head's layout)."""
    info = get_tp_info()
    if info.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(info.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def tp_min_over_ranks(value: int) -> int:
    """One all-reduce on the CPU group, so every rank plans the same KV pool."""
    if _TP_CPU_GROUP is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP_CPU_GROUP)
    return int(t.item())


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's tensor on every rank: sampled tokens agree by construction, not by luck of the RNG."""
    if _TP_INFO is not None and _TP_INFO.size > 1:
        dist.broadcast(x, src=0, group=_TP_GROUP)
    return x


def div_even(a: int, b: int, allow_replicate: bool = False) -> int:
    """a / b when b divides a; with allow_replicate, 1 when a < b and b % a == 0 (each item shared by b / a ranks)."""
    if allow_replicate and a < b:
        if b % a != 0:
            raise ValueError(f"{a} heads cannot be replicated evenly over TP size {b}")
        return 1
    if a % b != 0:
        raise ValueError(f"{a} is not divisible by TP size {b}")
    return a // b
