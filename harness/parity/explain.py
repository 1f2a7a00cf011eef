"""python -m harness parity ... --explain: which layer of the engine departs from HF first.

The failing prompt runs again, teacher-forced up to the failing position N, through the engine (along the failing
path's configuration, eagerly: CUDA graphs would replay past the hooks) and through HF, with hooks on the residual
stream after each layer's attention and after its MLP (harness.parity.hooks). At every position up to N:

- the engine's relative error against HF fp32 (sdpa): |engine - HF fp32| / |HF fp32| per position;
- HF's own spread in the engine's dtype: HF in that dtype, with sdpa and with eager attention, against HF fp32 sdpa,
  the same measure. That is the difference a correct implementation in this dtype carries: in half precision the
  rounding of every op (the attention kernel alone, sdpa vs eager in the dtype, leaves out the GEMMs' and norms'
  rounding, which dominates); in fp32, where HF fp32 against itself is exactly 0, the attention kernel's.

Each (layer, half) takes the largest over the positions; it diverges when the engine's exceeds
max(SPREAD_FACTOR x HF's spread, FLOOR[dtype]). The first one that does, in the order the model computes them, is where
the engine's computation departs: a fault there moves every later one too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import golden as G
from harness import zoo
from harness.driver import Driver
from harness.parity.failure import first_failure
from harness.parity.gate import SPREAD_FACTOR, ParityResult
from harness.parity.hooks import HALVES, EngineStreams, hf_streams
from harness.parity.paths import PATHS, ParityPath
from harness.parity.run import plan_path

# The smallest relative error of a residual stream that counts as a divergence, whatever HF's spread: fp32 engines
# differ from HF by their GEMMs' summation order (~1e-6 relative on these streams), far below any real fault's 1e-2.
FLOOR = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}


@dataclass
class LayerRow:
    layer: int
    half: str  # attention | mlp
    engine_err: float  # the engine's largest relative error against HF fp32 over the positions
    hf_spread: float  # HF's own, in the engine's dtype
    limit: float

    @property
    def diverges(self) -> bool:
        return self.engine_err > self.limit


@dataclass
class Explanation:
    model: str
    device: str
    dtype: str
    path: str
    prompt: int
    position: int  # positions 0..position were compared
    spread_kind: str
    rows: List[LayerRow]

    @property
    def first(self) -> LayerRow | None:
        return next((r for r in self.rows if r.diverges), None)


def _relative(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[layers, 2]: per (layer, half) the largest over positions of |a - ref| / |ref| (norms over hidden)."""
    return ((a - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).amax(dim=-1)


def engine_streams(model: str, device: str, dtype: str, gs: G.GoldenSet, path: ParityPath, prompt: int,
                   position: int) -> torch.Tensor:
    """The engine's streams [layers, 2, position + 1, hidden] on prompt `prompt` of gs, teacher-forced up to
    `position`, with the path's engine and driver settings but no CUDA graphs."""
    pg = gs.prompts[prompt]
    one = G.GoldenSet([pg], gs.provenance)
    plan = plan_path(path, device, dtype, one)
    steps = max(position - len(pg.prompt_ids) + 2, 1)  # the prefill, then a decode step per position after it
    engine = Engine(EngineConfig(model_path=str(zoo.path(model)), tp_info=DistributedInfo(0, 1),
                                 **dict(plan.engine_kwargs, cuda_graph_max_bs=0, prefill_graph_tokens=0)))
    try:
        streams = EngineStreams(list(engine.model.model.layers))
        with streams.capture():
            Driver(engine, max_prefill_tokens=plan.max_prefill_tokens).generate(
                plan.prompts, SamplingParams(max_tokens=steps, ignore_eos=True),
                **dict(plan.args[0], forced=[pg.tokens[:steps].tolist()]))
        return streams.stacked(list(range(position + 1)))
    finally:
        engine.shutdown()


def explain(model: str, device: str, dtype: str, gs: G.GoldenSet, path: ParityPath, prompt: int,
            position: int) -> Explanation:
    """Compare the engine's residual stream with HF's at positions 0..position of golden prompt `prompt`."""
    pg = gs.prompts[prompt]
    ids = [int(t) for t in pg.prompt_ids] + [int(t) for t in pg.tokens]
    position = min(position, len(ids) - 2)  # the last golden token is never an input
    ids = ids[: position + 1]
    eng = engine_streams(model, device, dtype, gs, path, prompt, position)
    hf = G.hf_model(model, device, torch.float32)
    ref = hf_streams(hf, ids, device)
    half = dtype != "float32"
    spread = torch.zeros(ref.shape[:2])
    for attn in ("sdpa", "eager") if half else ("eager",):
        del hf
        hf = G.hf_model(model, device, getattr(torch, dtype), attn)
        spread = torch.maximum(spread, _relative(hf_streams(hf, ids, device), ref))
    del hf
    kind = (f"HF {dtype} (sdpa and eager attention) against HF float32 sdpa: the rounding a correct {dtype} "
            f"implementation carries in every op" if half else
            "HF float32 eager against HF float32 sdpa: in fp32 HF's only difference from itself is its attention")
    err = _relative(eng, ref)
    rows = [LayerRow(layer, name, float(err[layer, h]), float(spread[layer, h]),
                     max(SPREAD_FACTOR * float(spread[layer, h]), FLOOR[dtype]))
            for layer in range(err.shape[0]) for h, name in enumerate(HALVES)]
    return Explanation(model, device, dtype, path.name, prompt, position, kind, rows)


def format_explanation(e: Explanation) -> str:
    lines = [f"explain: {e.model} on {e.device} in {e.dtype}, path {e.path}, prompt {e.prompt}: the residual stream "
             f"after each layer's attention and MLP at positions 0..{e.position} (the failing one and every one "
             f"before it), the largest over them of |x - HF fp32| / |HF fp32| per position",
             f"  engine: the engine (teacher-forced, no CUDA graphs) against HF float32 sdpa",
             f"  HF spread: {e.spread_kind}",
             f"  limit: max({SPREAD_FACTOR:g} x HF spread, {FLOOR[e.dtype]:g})",
             f"  {'layer':>5}  {'half':<9}  {'engine':>9}  {'HF spread':>9}  {'limit':>9}  {'engine/limit':>12}"]
    for r in e.rows:
        mark = "  <- diverges" if r.diverges else ""
        lines.append(f"  {r.layer:>5}  {r.half:<9}  {r.engine_err:>9.3g}  {r.hf_spread:>9.3g}  {r.limit:>9.3g}  "
                     f"{r.engine_err / r.limit:>12.3g}{mark}")
    first = e.first
    lines.append(f"first diverging layer: {first.layer} ({first.half})" if first else
                 "first diverging layer: none (every layer's stream is within HF's spread: look past the layers, "
                 "at the final norm, the LM head, the sampler, or what differs only under CUDA graphs)")
    return "\n".join(lines)


def explain_failure(result: ParityResult, gs: G.GoldenSet) -> str:
    """--explain on a failing ParityResult: its first failure's prompt and position, along its path."""
    f = first_failure(result)
    path = next(p for p in PATHS if p.name == f.path)
    return format_explanation(explain(result.model, result.device, result.dtype, gs, path, f.prompt, f.position))
