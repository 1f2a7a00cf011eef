"""The sampling grid's cases: small hand-made vocabularies that put each rule on the spot, and real logits.

Small rows use vocabularies whose ranking is not the id order (a sort or scatter slip shows), and keep every
top-p / min_p threshold well clear of the mass it is compared with; the tie cases put exact ties (equal float32
logits) on the top-k and top-p boundaries, where every tied token must stay. Real rows come from SmolLM2-135M and
Gemma 3 270M run by the engine itself, through the harness's driver (49152 and 262144 tokens; computed on each run,
never cached).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Sequence

import numpy as np
import torch

from engine.core import SamplingParams

if TYPE_CHECKING:
    from harness.models import ModelRef

NAN, NEG_INF = float("nan"), float("-inf")
REAL_MODELS = ("smollm2-135m", "gemma3-270m")  # 49152 and 262144 tokens
REAL_PROMPTS = ("Once upon a time, there was a", "The best way to learn")  # broad and medium entropy at T=1


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    logits: np.ndarray  # [rows, vocab] float32
    params: Sequence[SamplingParams]

    def __post_init__(self) -> None:
        if self.logits.ndim != 2 or self.logits.shape[0] != len(self.params):
            raise ValueError(f"case {self.name}: need one logits row per SamplingParams")

    @property
    def vocab(self) -> int:
        return self.logits.shape[1]


def SP(t: float = 1.0, k: int = -1, p: float = 1.0, m: float = 0.0) -> SamplingParams:
    return SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)


GREEDY = SP(t=0.0)
L12 = [1.0, -0.5, 3.0, 0.0, 2.2, -4.0, 2.5, 0.5, -1.0, 2.0, -2.0, 1.5]  # ranked order is not id order
L12B = [0.3, 1.7, -0.2, 2.9, 0.8, 1.1, -1.5, 2.4, 0.0, -3.0, 1.9, 0.6]
SPEC = [5.0, 4.0, 3.0, 0.0, 0.0, 0.0]
TRAP = list(np.log([0.2, 0.4, 0.1, 0.3]))  # k=2, p=0.5: top-k then renormalize keeps 0.4 alone (0.4/0.7 >= 0.5)
TIE_K = [0.0, 2.0, 1.0, 3.0, 1.0, -1.0, 1.0, 0.5, 1.0, -2.0]  # four-way tie at 1.0 (ids 2, 4, 6, 8) after ranks 3, 1
TIE_P = [0.0, 2.0, 0.0, 2.0, -1.0, 2.0, 2.0, -3.0]  # four-way tie at 2.0 (ids 1, 3, 5, 6) holding 92% of the mass
DYADIC = [NEG_INF, 0.0, 0.0, NEG_INF, 0.0, 0.0]  # four tokens of exactly 0.25: cumulative masses .25, .5, .75, 1


def _rows(*rows: Sequence[float]) -> np.ndarray:
    return np.array(rows, dtype=np.float32)


def _spaced(base: float, unit: float, steps: Sequence[float]) -> List[float]:
    """Logits base - step * unit: with unit a power of two the division by temperature = unit is exact."""
    return [base - s * unit for s in steps]


def small_cases() -> List[Case]:
    t19, t10 = 2.0 ** -19, 2.0 ** -10
    near_tie = [2.0, 1.0, 3.0 - 2.0 ** -21, 0.5, 3.0, 0.0]  # id 4 beats id 2 by 5e-7: at T=1e-6 that is e^-0.48
    exact_tie = [2.0, 3.0, 3.0, 0.5, 1.0, 0.0]  # argmax = id 1, the lower of the two maxima
    return [
        Case("spec", "the spec's example: top-k 2, top-p 0.5, greedy on [5,4,3,0,0,0]",
             _rows(SPEC, SPEC, SPEC), [SP(k=2), SP(p=0.5), GREEDY]),
        Case("temperature", "temperature only, per row", _rows(L12, L12, L12), [SP(1.0), SP(0.5), SP(2.0)]),
        Case("top-k", "top-k, with k = vocab and k > vocab meaning no limit",
             _rows(L12, L12, L12, L12), [SP(k=3), SP(0.7, k=5), SP(1.5, k=12), SP(k=20)]),
        Case("top-p", "top-p alone", _rows(L12, L12, L12), [SP(p=0.5), SP(p=0.8), SP(1.5, p=0.95)]),
        Case("top-k+top-p", "top-k first, then top-p on the renormalized rest",
             _rows(TRAP + [NEG_INF] * 8, L12, L12), [SP(k=2, p=0.5), SP(k=5, p=0.7), SP(1.3, k=6, p=0.9)]),
        Case("min_p", "min_p on the full tempered distribution, alone and intersected with top-k / top-p",
             _rows(L12, L12, L12, L12), [SP(m=0.1), SP(2.0, m=0.3), SP(k=5, m=0.2), SP(p=0.9, m=0.05)]),
        Case("greedy-mixed", "greedy rows (temperature 0, top_k 1) among sampled rows",
             _rows(L12, L12B, L12, L12B), [GREEDY, SP(1.0), SP(0.8, k=1), SP(p=0.9)]),
        Case("greedy-ties", "greedy rows on an exact tie and a 5e-7 near tie, in a mixed batch",
             _rows(exact_tie, near_tie, exact_tie), [GREEDY, GREEDY, SP(1.0)]),
        Case("greedy-only", "an all-greedy batch (argmax path) on the same ties",
             _rows(exact_tie, near_tie), [GREEDY, GREEDY]),
        Case("per-row", "every row its own logits and parameters",
             _rows(L12, L12B, list(reversed(L12)), L12B, [x * 0.5 for x in L12]),
             [SP(0.8, k=4), SP(1.2, p=0.85), SP(m=0.15), GREEDY, SP(0.6, k=7, p=0.9, m=0.02)]),
        Case("tie-top-k", "a four-way tie straddles k: every tied token is kept",
             _rows(TIE_K, TIE_K, TIE_K), [SP(k=4), SP(0.5, k=3), SP(k=5, p=0.95)]),
        Case("tie-top-p", "a four-way tie holds the top-p crossing token: every tied token is kept",
             _rows(TIE_P, TIE_P, TIE_P), [SP(p=0.6), SP(p=0.3), SP(k=3, p=0.9)]),
        Case("tie-exact-mass", "top_p exactly on a cumulative mass inside a tie, and k inside it: all four kept",
             _rows(DYADIC, DYADIC, DYADIC), [SP(p=0.5), SP(p=0.75), SP(k=3, p=0.5)]),
        Case("small-temperature", "temperatures 2^-19, 2^-10 and 0.05 on finely spaced logits",
             _rows(_spaced(10.0, t19, [2, 0, 1, 3, 5, 4, 6, 8]), _spaced(0.0, t10, [0, 0.5, 1, 2, 3, 4, 1.5, 7]),
                   [1.0, 0.95, 0.9, 0.8, 0.5, 0.85, 0.2, 0.97]),
             [SP(t19), SP(t10, p=0.9), SP(0.05)]),
        Case("invalid-rows", "a NaN row and an all -inf row give -1; the other rows are drawn as usual",
             _rows(L12, L12[:5] + [NAN] + L12[6:], [NEG_INF] * 12, L12B),
             [SP(1.0), SP(1.0), SP(0.7, k=5), SP(0.7, k=5, p=0.9)]),
        Case("invalid-greedy", "NaN and all -inf rows in an all-greedy batch",
             _rows(L12, [NAN] * 12, [NEG_INF] * 12), [GREEDY, GREEDY, GREEDY]),
    ]


def real_logits(model: "ModelRef | str", prompts: Sequence[str] = REAL_PROMPTS) -> np.ndarray:
    """The engine's next-token log-probabilities [len(prompts), vocab] float32 (CPU, fp32), through the driver.

    Log-probabilities are the logits shifted by a per-row constant, which no sampling rule can see."""
    from engine.config import EngineConfig
    from engine.distributed import DistributedInfo
    from engine.engine import Engine
    from engine.utils.hf import load_tokenizer
    from harness.driver import Driver
    from harness.models import as_model

    path = str(as_model(model).folder)
    threads = torch.get_num_threads()  # the Engine sets its own; the draws afterwards want them all back
    engine = Engine(EngineConfig(model_path=path, tp_info=DistributedInfo(0, 1), dtype=torch.float32, device="cpu",
                                 max_running_req=len(prompts), cuda_graph_max_bs=0, num_page_override=1024,
                                 max_seq_len_override=256))
    try:
        ids = [load_tokenizer(path)(p).input_ids for p in prompts]
        last: dict = {}

        def keep_last(uid: int, first_pos: int, logprobs: torch.Tensor) -> None:
            if first_pos + len(logprobs) == len(ids[uid]):  # the row after the prompt's last token
                last[uid] = logprobs[-1].numpy()

        Driver(engine).generate(ids, SamplingParams(max_tokens=1), on_logits=keep_last)
        return np.stack([last[i] for i in range(len(prompts))]).astype(np.float32)
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


def real_cases(model: "ModelRef | str" = REAL_MODELS[0], logits: np.ndarray | None = None,
               first: bool = True) -> List[Case]:
    """Two batches on one model's real logits: temperature only (no sort in the sampler), and the filters. The
    first model's cases are named real-*, the others' real-<the name's first part>-*."""
    a, b = logits if logits is not None else real_logits(model)
    model = model if isinstance(model, str) else model.name
    tag = "real" if first else f"real-{model.split('-')[0]}"
    return [
        Case(f"{tag}-temperature", f"{model}, {a.shape[0]} tokens: temperature 1 and 0.7, greedy",
             _rows(a, b, a), [SP(1.0), SP(0.7), GREEDY]),
        Case(f"{tag}-filters", f"{model}, {a.shape[0]} tokens: top-k+top-p, top-p, min_p",
             _rows(b, a, b), [SP(0.8, k=50, p=0.9), SP(1.0, p=0.8), SP(1.3, m=0.05)]),
    ]


def all_cases(real_models: Sequence["ModelRef | str"] = REAL_MODELS) -> List[Case]:
    return small_cases() + [c for i, m in enumerate(real_models) for c in real_cases(m, first=i == 0)]


def describe(params: SamplingParams) -> str:
    """A short label: t=0.7 k=5 p=0.9 m=0.02 (defaults left out); greedy for greedy rows."""
    if params.is_greedy:
        return "greedy" if params.top_k != 1 else f"greedy (t={params.temperature:g}, k=1)"
    parts = [f"t={params.temperature:.3g}" if params.temperature >= 1e-3 else
             f"t=2^{math.log2(params.temperature):.0f}"]
    parts += [f"k={params.top_k}"] if params.top_k != -1 else []
    parts += [f"p={params.top_p:g}"] if params.top_p != 1.0 else []
    parts += [f"m={params.min_p:g}"] if params.min_p != 0.0 else []
    return " ".join(parts)
