"""Tensor-parallel rank info and the process groups (created only when TP > 1)."""

from __future__ import annotations

import datetime
import logging
import sys
import time
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


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
_SERVER: dist.TCPStore | None = None  # rank 0: the rendezvous store's server, held here alone
_CLIENT: dist.TCPStore | None = None  # this rank's client of it, once the world is joined
_TIMEOUT_S = 60.0
_CLOSING_KEY = "engine/tp/closing"  # set by rank 0 as its world ends; a fresh server never has it
_LEFT_KEY = "engine/tp/left"  # /<rank>: that rank saw the mark and is leaving
_ACK_WAIT_S = 10.0  # how long rank 0 waits for the others' acknowledgements before stopping its server anyway


def set_tp_info(rank: int, size: int) -> None:
    global _TP_INFO
    _TP_INFO = DistributedInfo(rank, size)


def get_tp_info() -> DistributedInfo:
    assert _TP_INFO is not None, "TP info is set by Engine.__init__"
    return _TP_INFO


def _parse_tcp_addr(addr: str) -> Tuple[str, int]:
    if not addr.startswith("tcp://") or ":" not in addr[len("tcp://"):]:
        raise ValueError(f"distributed address must look like tcp://host:port, got {addr!r}")
    host, port = addr[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


def _connect(host: str, port: int, size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of rank 0's store, never of a server that is closing (the previous world's, on the same port)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        client = dist.TCPStore(host, port, size, is_master=False, timeout=timeout, wait_for_workers=False)
        try:
            if not client.check([_CLOSING_KEY]):
                return client
        except dist.DistNetworkError:  # it stopped between the connect and the check
            pass
        del client
        if time.monotonic() > deadline:
            raise TimeoutError(f"the rendezvous store at {host}:{port} stayed in its closing state")
        time.sleep(0.02)


def init_process_groups(info: DistributedInfo, device: torch.device, addr: str, timeout_s: float) -> dist.ProcessGroup:
    """Join the TP world. A rank that never arrives makes the others fail after `timeout_s`, not hang.

    The rendezvous store: rank 0 serves it on addr's port, and every rank (rank 0 too) gives the process group a
    client of it. Only this module holds the server, so destroy_process_groups stops it even while something (an
    Engine attribute) still holds the group: a next world on the same port rendezvouses on a fresh server, never on
    the previous world's keys (torch names the default group's keys the same in every world: a rank that read the
    old ones would dial the old world's gloo addresses and time out).
    """
    global _TP_GROUP, _TP_CPU_GROUP, _SERVER, _CLIENT, _TIMEOUT_S
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process: shut the previous Engine down "
                           "(Engine.shutdown destroys its groups) before starting another with TP > 1")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    _TIMEOUT_S = timeout_s
    try:
        host, port = _parse_tcp_addr(addr)
        if info.is_primary():
            _SERVER = dist.TCPStore(host, port, info.size, is_master=True, timeout=timeout, wait_for_workers=False)
        client = _connect(host, port, info.size, timeout)
        dist.init_process_group(backend, store=client, rank=info.rank, world_size=info.size, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
        _CLIENT = client  # joined: destroy_process_groups waits for rank 0's shutdown through it
    except Exception as e:  # torch's message is one line of cause followed by C++ frames
        cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(
            f"TP rank {info.rank} of {info.size} could not join the TP world at {addr} within "
            f"distributed_timeout={timeout_s:g} s: {type(e).__name__}: {cause} (every rank must be started, "
            "with the same distributed_port, and rank 0's port must be free)") from e
    _TP_GROUP = dist.group.WORLD
    _TP_CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else _TP_GROUP
    return _TP_CPU_GROUP


def destroy_process_groups(handshake: bool | None = None) -> None:
    """Leave the TP world; after this a new world may start in this process, on the same port too.

    The handshake, on the store: rank 0 marks it closing; every other rank waits for the mark (at most
    distributed_timeout), i.e. until rank 0 is shutting down as well, and acknowledges it; rank 0 then stops the server
    (after every acknowledgement, or _ACK_WAIT_S). A rank that raced ahead into the next world's rendezvous could
    otherwise reach the old server and its keys; the mark makes the next _connect skip it for the moments it still
    lives. Nothing touches a stopped server, so a clean shutdown logs nothing.

    handshake=None: skip it when called while an exception is being handled (Engine.__init__'s failed start): the
    ranks are out of step then, and waiting for each other would only delay the failure. Rank 0 still marks and stops
    its server.
    """
    global _TP_GROUP, _TP_CPU_GROUP, _TP_INFO, _SERVER, _CLIENT
    if dist.is_initialized():
        dist.destroy_process_group()
    if handshake is None:
        handshake = sys.exc_info()[0] is None
    info, server, client = _TP_INFO, _SERVER, _CLIENT
    _SERVER = _CLIENT = None
    _TP_GROUP = _TP_CPU_GROUP = _TP_INFO = None
    try:
        if server is not None:
            server.set(_CLOSING_KEY, "1")
            if handshake and client is not None and info is not None:  # the world was joined: the others will ack
                left = [f"{_LEFT_KEY}/{r}" for r in range(1, info.size)]
                server.wait(left, datetime.timedelta(seconds=min(_TIMEOUT_S, _ACK_WAIT_S)))
        elif handshake and client is not None and info is not None:
            client.wait([_CLOSING_KEY], datetime.timedelta(seconds=_TIMEOUT_S))
            client.add(f"{_LEFT_KEY}/{info.rank}", 1)
    except Exception as e:  # noqa: BLE001 - a peer crashed, hangs or never shut down: leave anyway
        logger.warning("TP shutdown handshake incomplete (a rank crashed or did not shut down?): %s",
                       str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    del server, client  # rank 0: the last reference to the server, which stops now


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
