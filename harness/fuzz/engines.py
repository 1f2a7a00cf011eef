"""Engines for a fuzz run. One Engine may live in a process (the global context), so the engine under test lives in
this process and the engines it is compared with (the reference, the eager twin of a graph engine) each in a spawned
process of its own, driven over a pipe. Each is rebuilt only when a configuration asks for another."""

from __future__ import annotations

import pickle
import traceback
from typing import Any, Dict

import torch
import torch.multiprocessing as mp

from engine import Engine, EngineConfig
from engine.distributed import DistributedInfo
from harness.models import ModelRef

WORKER_TIMEOUT = 900.0  # seconds one request to a worker may take (a reference run of a whole workload)


class EngineHost:
    """The one Engine of this process, kept while the configuration stays the same. threads: the CPU thread count it
    runs at (None: the engine's own, physical cores)."""

    def __init__(self, model: ModelRef, threads: int | None = 1) -> None:
        self.model, self.threads = model, threads
        self.kwargs: Dict[str, Any] | None = None
        self.engine: Engine | None = None
        self.builds = 0  # engines built so far: which one a case ran on

    def get(self, kwargs: Dict[str, Any]) -> Engine:
        if self.engine is None or kwargs != self.kwargs:
            self.close()
            self.engine = Engine(EngineConfig(model_path=str(self.model.folder), tp_info=DistributedInfo(0, 1),
                                              **kwargs))
            self.kwargs = kwargs
            self.builds += 1
            # A fuzz forward is a few small ops: one thread beats a team that meets at every op (17x on a shared
            # 2-core host), and every engine of a run uses the same count, so their CPU numerics are the same.
            if self.threads is not None:
                torch.set_num_threads(self.threads)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.kwargs = None, None


class WorkerError(RuntimeError):
    """A worker's engine raised, or the worker died: the message holds its traceback."""


def _serve(conn: Any, model: ModelRef, threads: int | None, plant: str | None) -> None:
    from harness.fuzz.faults import planted
    from harness.fuzz.runs import run_workload

    host = EngineHost(model, threads)
    with planted(plant):  # a fault planted in a worker stays for its life
        try:
            while True:
                cmd, payload = pickle.loads(conn.recv_bytes())
                if cmd == "close":
                    return
                try:
                    if cmd == "configure":
                        host.get(payload)
                        result: Any = None
                    else:
                        result = run_workload(host.engine, payload)
                    conn.send_bytes(pickle.dumps((True, result)))
                except Exception:
                    conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
        finally:
            host.close()


class EngineWorker:
    """An Engine in a spawned process: configure(kwargs) builds it (when they changed), run(spec) runs a workload
    on it (harness.fuzz.runs.run_workload) and returns the RunOutput. threads: its CPU thread count (None: the
    engine's own); plant: a planted fault (harness.fuzz.faults) active in that process."""

    def __init__(self, name: str, model: ModelRef, threads: int | None = 1, plant: str | None = None) -> None:
        self.name, self.model, self.threads, self.plant = name, model, threads, plant
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, self.model, self.threads, self.plant), daemon=True,
                                name=f"fuzz-{self.name}")
        self.proc.start()
        child.close()
        self.kwargs: Dict[str, Any] | None = None

    def configure(self, kwargs: Dict[str, Any], fresh_process: bool = False, plant: str | None = None) -> None:
        """Build the engine of kwargs when they changed; fresh_process: then in a newly started process (its memory
        laid out anew), so that a configuration's comparisons against this process are against another process,
        with `plant` planted there."""
        if fresh_process and plant != self.plant:
            self.close()
            self.plant = plant
            self._start()
        if kwargs != self.kwargs:
            if fresh_process and self.kwargs is not None:
                self.close()
                self._start()
            self._call("configure", kwargs)
            self.kwargs = kwargs

    def run(self, spec: Any) -> Any:
        return self._call("run", spec)

    def _call(self, cmd: str, payload: Any) -> Any:
        try:
            self.conn.send_bytes(pickle.dumps((cmd, payload)))
            if not self.conn.poll(WORKER_TIMEOUT):
                raise WorkerError(f"the {self.name} engine did not answer {cmd} within {WORKER_TIMEOUT:.0f} s")
            ok, result = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise WorkerError(f"the {self.name} engine's process died (exit code {self.proc.exitcode})") from e
        if not ok:
            raise WorkerError(f"the {self.name} engine raised:\n{result}")
        return result

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(pickle.dumps(("close", None)))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()
