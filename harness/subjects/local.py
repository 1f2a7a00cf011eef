"""A driven engine (this project's, or python:MODULE:CLASS) as a Subject: the harness's driver over one engine."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness.bench.arrivals import Timing, Trace, replay
from harness.driver import Driver
from harness.step_budget import StepBudget
from harness.subjects.base import Scored, Subject
from harness.subjects.spec import engine_class

SLOTS = 64  # requests running at once: the sampling grid's draws go through in batches of this many
SEQ_LEN = 4096  # the longest request: the peer bench's 2048-token prompts fit
POOL_TOKENS = 16384  # the KV pool: pages are taken as requests need them, not SEQ_LEN per slot


def serving_engine(config: EngineConfig, serving: Dict[str, Any]) -> EngineConfig:
    """The checks' engine resized for a serving trace: slots requests at once, sequences of max_seq_len, the KV pool
    as the memory plan sizes it; on a GPU in bf16 with CUDA graphs (a mixed step of every slot's decode and a chunk
    replays a prefill graph), and dummy weights for a folder without any."""
    cuda = config.device.startswith("cuda")
    dummy = not any(Path(config.model_path).glob("*.safetensors"))
    return dataclasses.replace(config, max_running_req=serving["slots"], max_seq_len_override=serving["max_seq_len"],
                               num_page_override=None, dtype=torch.bfloat16 if cuda else torch.float32,
                               cuda_graph_max_bs=None if cuda else 0, prefill_graph_max_reqs=serving["slots"] + 1,
                               use_dummy_weight=dummy)


class LocalSubject(Subject):
    top_k = 64  # every position's whole distribution is at hand; the goldens keep 64

    def __init__(self, spec: str, folder: Path, device: str = "cpu", serving: Dict[str, Any] | None = None) -> None:
        """serving: an engine sized for a serving trace instead of the checks' (serving_engine)."""
        self.spec, self.folder = spec, folder
        threads = torch.get_num_threads()  # an Engine sets its own; the caller's come back after it
        config = EngineConfig(
            model_path=str(folder), tp_info=DistributedInfo(0, 1), dtype=torch.float32, device=device,
            max_running_req=SLOTS, cuda_graph_max_bs=0, max_seq_len_override=SEQ_LEN,
            num_page_override=POOL_TOKENS)
        self.serving = serving
        self.engine = engine_class(spec)(serving_engine(config, serving) if serving else config)
        self._threads = threads
        self.driver = Driver(self.engine)
        if serving and serving.get("stall"):
            from harness.bench.step_cost import measure

            self.step_cost = measure(self.driver, serving["cost_depth"], serving["slots"])
            self.driver = Driver(self.engine, step_budget=StepBudget(self.step_cost.cost, stall=serving["stall"]))

    def provenance(self) -> Dict[str, Any]:
        out = {"engine": self.spec, "model": self.folder.name}
        if self.serving:
            budget = self.driver.budget
            out["step_budget"] = (f"stall {budget.stall} over a measured cost {budget.cost}" if budget.stall else
                                  f"{budget.tokens} tokens at depth 0 (FLOP-weighted)")
            if budget.stall:
                out["step_cost_fit"] = {"steps": self.step_cost.steps,
                                        "median_residual": self.step_cost.median_residual}
        return out

    def score(self, prompts: Sequence[List[int]], max_new: Sequence[int], k: int) -> List[Scored]:
        got: Dict[int, Dict[int, tuple]] = {i: {} for i in range(len(prompts))}

        def keep(uid: int, start: int, lp: torch.Tensor) -> None:
            top = lp.float().topk(k, dim=-1)
            for i in range(lp.shape[0]):
                got[uid][start + i] = (top.indices[i].numpy().astype(np.int64), top.values[i].double().numpy())

        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_new]
        results = self.driver.generate(prompts, params, on_logits=keep)
        out = []
        for uid, res in enumerate(results):
            positions = sorted(got[uid])
            out.append(Scored(res.output_ids, np.stack([got[uid][p][0] for p in positions]),
                              np.stack([got[uid][p][1] for p in positions])))
        return out

    def sample(self, prompt: List[int], params: SamplingParams, n: int, seed: int) -> np.ndarray:
        reqs = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                               min_p=params.min_p, max_tokens=1, ignore_eos=True, seed=seed + i) for i in range(n)]
        results = self.driver.generate([prompt] * n, reqs)
        return np.array([r.output_ids[0] for r in results], dtype=np.int64)

    def timed(self, prompts: Sequence[List[int]], max_new: int) -> float:
        start = time.perf_counter()
        self.driver.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
        return time.perf_counter() - start

    def serve(self, trace: Trace) -> List[Timing]:
        return replay(self.driver, trace, lambda n: SamplingParams(max_tokens=n, ignore_eos=True))

    def close(self) -> None:
        self.engine.shutdown()
        torch.set_num_threads(self._threads)
