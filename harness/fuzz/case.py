"""A fuzz case as plain data: the engine configuration, the workload, and what failed; JSON both ways."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from engine.core import SamplingParams
from harness import UserError

MAX_SEQ_LEN = 128  # max_seq_len of the engines of a short-tier run: far above any request its strategies draw
MAX_PROMPT = 40
MAX_NEW = 16
MAX_REQUESTS = 8
# the long tier (`fuzz --long`): prompts past a block of 1024 pages at page_size 1 (past 64 pages at 16), where page
# lists take a second block and the gathered keys a second thousand; a prompt sharing a deep prefix with the one before
LONG_PROMPT = (1025, 1400)
LONG_NEW = 4
LONG_SEQ_LEN = 1536  # max_seq_len of the engines of a long-tier run: LONG_PROMPT's longest + LONG_NEW, rounded up
CASE_VERSION = 2  # 2: the history a case needs; version 1 files (no history) are read too


@dataclass(frozen=True)
class FuzzConfig:
    """The engine and the driver under test. Engines are built from the first six fields and batch_invariant;
    max_prefill_tokens and overlap are the driver's, so configurations that differ only there share an engine."""

    dtype: str  # float32 | bfloat16 | float16
    attention_backend: str  # torch | flashinfer | cpu; the small ops follow it (FlashInfer's fused kernels, torch's, or
    # the CPU's default: oneDNN's GEMMs and the C++ RoPE and activation beside the cpu kernel)
    graphs: bool  # decode CUDA graphs (FlashInfer only)
    slots: int  # max_running_req: page-table rows
    page_size: int
    pool_tokens: int  # the KV pool holds pool_tokens // page_size pages: small enough that requests wait for pages
    max_prefill_tokens: int  # the driver's token budget of one prefill step
    overlap: bool  # the loop of the main and forced runs; the other loop runs as the overlap-vs-simple check
    batch_invariant: bool = False  # EngineConfig.batch_invariant; adds the alone invariant (bitwise, per request)
    max_seq_len: int = MAX_SEQ_LEN  # of every engine of the case: above any request its tier draws

    @property
    def num_pages(self) -> int:
        return self.pool_tokens // self.page_size

    def engine_kwargs(self, device: str) -> Dict[str, Any]:
        """EngineConfig fields (besides the model) of the engine under test."""
        return dict(dtype=getattr(torch, self.dtype), device=device, attention_backend=self.attention_backend,
                    ops_backend="auto" if self.attention_backend == "cpu" else self.attention_backend,
                    page_size=self.page_size, max_running_req=self.slots,
                    num_page_override=self.num_pages, max_seq_len_override=self.max_seq_len,
                    cuda_graph_max_bs=None if self.graphs else 0, batch_invariant=self.batch_invariant)

    def eager_kwargs(self, device: str) -> Dict[str, Any]:
        """The same engine without CUDA graphs: graphs vs eager must agree bitwise (the same kernels)."""
        return dict(self.engine_kwargs(device), cuda_graph_max_bs=0)

    def reference_kwargs(self, device: str) -> Dict[str, Any]:
        """The reference: one slot, page_size 1, no graphs, the same dtype and kernels, a pool for any request."""
        return dict(self.engine_kwargs(device), page_size=1, max_running_req=1, num_page_override=self.max_seq_len,
                    cuda_graph_max_bs=0)


@dataclass(frozen=True)
class RequestSpec:
    prompt: Tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    prefix_len: int = 0  # > 0: the first prefix_len prompt tokens are prefilled first, the rest extends over them

    def params(self, ignore_eos: bool | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              seed=self.seed, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos if ignore_eos is None else ignore_eos)

    @property
    def uid_free(self) -> bool:
        """Its tokens do not depend on its uid (greedy, or a seed of its own), so alone and in a batch compare."""
        return self.seed is not None or self.params().is_greedy


@dataclass(frozen=True)
class Workload:
    requests: Tuple[RequestSpec, ...]  # in arrival order (uid = index)
    # EOS ids planted in the vocabulary: (request, step) names the token the reference of that request samples at
    # that step, so EOS stops really happen (a random id would almost never be sampled)
    eos: Tuple[Tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Failure:
    invariant: str  # runs, pool-pages, pool-writes, kv-reference, logits-reference, overlap-simple, repeat,
    #                 graphs-eager, process, seeded-alone, batch-invariant
    stage: str  # the run it was seen in: main, forced, other-loop, repeat, eager-twin, process-twin, alone
    details: str

    def same_bug(self, other: "Failure") -> bool:
        return (self.invariant, self.stage) == (other.invariant, other.stage)


@dataclass(frozen=True)
class Past:
    """A case an engine ran before the failing one, and which of its runs: all (only None) or the runs a failure
    needs (the search's shrinking evaluates only those, and the engine's state depends on what ran)."""
    workload: Workload
    only: Failure | None = None


@dataclass
class Case:
    model: str
    device: str
    config: FuzzConfig
    workload: Workload
    failure: Failure | None = None
    planted: str | None = None  # the planted fault that was active when it was found
    seed: int | None = None
    version: int = CASE_VERSION
    # the cases a fresh engine runs before this one for the failure to show (the engine keeps state across cases),
    # and how the search's last check reproduced it
    history: Tuple[Past, ...] = ()
    reproduced: str = ""
    model_args: str = ""  # the command-line arguments that name the model (default: --model <model>)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Case":
        d = json.loads(text)
        if d.get("version") not in (1, CASE_VERSION):
            raise ValueError(f"fuzz case version {d.get('version')!r}, this harness reads versions 1 and "
                             f"{CASE_VERSION}")

        def workload(w: dict) -> Workload:
            return Workload(tuple(RequestSpec(**dict(r, prompt=tuple(r["prompt"]))) for r in w["requests"]),
                            tuple(tuple(e) for e in w["eos"]))

        return cls(d["model"], d["device"], FuzzConfig(**d["config"]), workload(d["workload"]),
                   Failure(**d["failure"]) if d["failure"] else None, d["planted"], d["seed"], CASE_VERSION,
                   tuple(Past(workload(h["workload"]), Failure(**h["only"]) if h["only"] else None)
                         for h in d.get("history", ())), d.get("reproduced", ""), d.get("model_args", ""))

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, path: Path) -> "Case":
        try:
            return cls.from_json(Path(path).read_text())
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path} is not a fuzz case written by `python -m harness fuzz`: {e}; give the JSON file "
                            "a failing search wrote (its path ends the search's output)") from e


def describe(workload: Workload) -> List[str]:
    """One line per request, for the terminal and the report."""
    lines = []
    for i, r in enumerate(workload.requests):
        p = r.params()
        sampling = "greedy" if p.is_greedy else f"T={r.temperature} top_k={r.top_k} top_p={r.top_p} min_p={r.min_p}"
        lines.append(f"request {i}: prompt {len(r.prompt)} tokens, max_tokens {r.max_tokens}, {sampling}"
                     + (f", seed {r.seed}" if r.seed is not None else "") + (", ignore_eos" if r.ignore_eos else "")
                     + (f", prefix {r.prefix_len}" if r.prefix_len else ""))
    if workload.eos:
        lines.append("EOS ids: the reference's tokens at (request, step) " + ", ".join(map(str, workload.eos)))
    return lines
