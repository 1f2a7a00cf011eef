"""A Subject in a worker process of its own, one JSON object a line each way: vLLM's (harness.subjects.vllm_worker,
in vLLM's interpreter) and a driven engine's (harness.subjects.local_worker, for the bench, where each side runs
in a process of its own and an engine of this project's may already be live in the harness's). A worker writes
{"ready": provenance} once loaded, then answers each request with its result or {"error": ...}; what it prints
otherwise goes to stderr."""

from __future__ import annotations

import json
import subprocess
from typing import Any, Dict, List, Sequence

import numpy as np

from engine.core import SamplingParams
from harness.bench.arrivals import Timing, Trace
from harness.subjects.base import Scored, Subject, rows


class ProcessSubject(Subject):
    def __init__(self, argv: List[str], env: Dict[str, str], top_k: int) -> None:
        self.top_k = top_k
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read("start")["ready"]

    def _read(self, what: str) -> Dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the worker process ended (exit {code}) during {what}; its log is above on stderr")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the worker process, {what}: {answer['error']}")
        return answer

    def _call(self, **req: Any) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(req["op"])

    def provenance(self) -> Dict[str, Any]:
        return dict(self.info)

    def score(self, prompts: Sequence[List[int]], max_new: Sequence[int], k: int) -> List[Scored]:
        got = self._call(op="score", prompts=[list(map(int, p)) for p in prompts], max_new=list(max_new), k=k)
        return [Scored(s["tokens"], *rows(s["rows"], k)) for s in got["scored"]]

    def sample(self, prompt: List[int], params: SamplingParams, n: int, seed: int) -> np.ndarray:
        p = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p}
        return np.array(self._call(op="sample", prompt=list(map(int, prompt)), params=p, n=n, seed=seed)["tokens"],
                        dtype=np.int64)

    def timed(self, prompts: Sequence[List[int]], max_new: int) -> float:
        return self._call(op="timed", prompts=[list(map(int, p)) for p in prompts], max_new=max_new)["seconds"]

    def serve(self, trace: Trace) -> List[Timing]:
        return [Timing(**t) for t in self._call(op="serve", trace=trace.to_json())["timings"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
