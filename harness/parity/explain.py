"""python -m harness parity ... --explain: which layer of the engine departs from HF first, and in which half.

The failing prompt runs again, teacher-forced up to the failing position N, through the engine (along the failing
path's configuration, eagerly: CUDA graphs would replay past the hooks) and through HF, with hooks on the residual
stream after each layer's attention and after its MLP (harness.parity.hooks), at every position up to N. Two views:

- the stream: each run on its own, |x - HF fp32| / |HF fp32| per position. Errors add up layer after layer, so in
  half precision a fault in one layer can hide under the rounding the layers before it carry.
- each layer alone (what decides): every layer's input replaced by HF fp32's stream before it, rounded to the
  engine's dtype, the same for every run; compared is what each half adds to the stream (the attention's output, the
  MLP's), |added - HF fp32's added| / |HF fp32's added| per position. Nothing carries over from earlier layers, and
  a fault shows at its own size relative to the half it is in.

Beside the engine's error stands HF's own spread in the engine's dtype, the same measure: in half precision HF in
that dtype with sdpa and with eager attention against HF fp32 sdpa, the larger (the rounding a correct
implementation in that dtype carries in every op; sdpa against eager in the dtype would show the attention kernel's
only); in fp32, where HF against itself is exactly 0, HF fp32 eager against sdpa (the attention kernel's).

Each error is taken as its median over the positions 0..N, and at N itself. The median, because a few positions
may differ for reasons of their own: where a half adds little, a relative error is large; in a mixture-of-experts
layer in half precision, a token at a router near tie may take another expert in the engine than in HF (which ones,
two correct kernels decide by luck). N, because a fault of a few positions (of a decode step, a page boundary) shows
there: parity failed there, and not at a router near tie. A half diverges when the engine's error alone exceeds
max(FACTOR x HF's, FLOOR[dtype]) either way; the first that does, in the order the model computes them, is where the
engine departs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import golden as G
from harness.driver import Driver
from harness.models import ModelRef, as_model, name_of
from harness.parity.failure import first_failure
from harness.parity.gate import ParityResult
from harness.parity.hooks import HALVES, EngineStreams, hf_streams
from harness.parity.paths import PATHS, ParityPath
from harness.parity.plan import plan_path

FACTOR = 3.0  # how far beyond HF's own spread the engine's error alone may go: SOURCES, as the gate's KL limits
# The smallest error alone that counts as a divergence, whatever HF's spread: in fp32 a correct engine's differs from
# HF's by summation order (about 1e-6 of what a half adds), far below a real fault's 1e-3 or more.
FLOOR = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}


@dataclass
class Measure:
    """Per (layer, half) [layers, 2]: the relative error's median over positions 0..N, and at the failing position N."""

    median: torch.Tensor
    at_n: torch.Tensor


def _measure(a: torch.Tensor, ref: torch.Tensor) -> Measure:
    """a, ref [layers, 2, P, hidden]."""
    rel = (a - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)  # [layers, 2, P]
    return Measure(rel.quantile(0.5, dim=-1), rel[..., -1])  # of an even count, the mean of the middle two


def _larger(a: Measure | None, b: Measure) -> Measure:
    return b if a is None else Measure(torch.maximum(a.median, b.median), torch.maximum(a.at_n, b.at_n))


@dataclass
class LayerRow:
    layer: int
    half: str  # attention | mlp
    stream: float  # the engine's stream against HF fp32's, the median over the positions
    hf_stream: float  # HF's own, in the engine's dtype
    alone: float  # what the half adds, each layer alone, the median over the positions
    hf_alone: float
    alone_n: float  # the same at the failing position
    hf_alone_n: float
    dtype: str

    def limit(self, hf: float) -> float:
        return max(FACTOR * hf, FLOOR[self.dtype])

    @property
    def diverges(self) -> bool:
        return self.alone > self.limit(self.hf_alone) or self.alone_n > self.limit(self.hf_alone_n)


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


def _updates(streams: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """[layers, 2, P, H]: what each half adds to the stream (the attention's to the layer's input, the MLP's to the
    stream after the attention)."""
    return torch.stack([streams[:, 0] - inputs, streams[:, 1] - streams[:, 0]], dim=1)


def engine_streams(model: ModelRef | str, device: str, dtype: str, gs: G.GoldenSet, path: ParityPath, prompt: int,
                   position: int, inputs: List[torch.Tensor | None]) -> List[torch.Tensor]:
    """Per entry of `inputs` (None: the engine's own stream; else each layer's input replaced, hooks.EngineStreams),
    the engine's streams [layers, 2, position + 1, hidden] on prompt `prompt` of gs, teacher-forced up to `position`,
    with the path's engine and driver settings but no CUDA graphs."""
    pg = gs.prompts[prompt]
    plan = plan_path(path, device, dtype, G.GoldenSet([pg], gs.provenance))
    steps = max(position - len(pg.prompt_ids) + 2, 1)  # the prefill, then a decode step per position after it
    engine = Engine(EngineConfig(model_path=str(as_model(model).folder), tp_info=DistributedInfo(0, 1),
                                 **dict(plan.engine_kwargs, cuda_graph_max_bs=0, prefill_graph_tokens=0)))
    out = []
    try:
        for replaced in inputs:
            streams = EngineStreams(list(engine.model.model.layers), replaced)
            with streams.capture():
                Driver(engine, max_prefill_tokens=plan.max_prefill_tokens).generate(
                    plan.prompts, SamplingParams(max_tokens=steps, ignore_eos=True),
                    **dict(plan.args[0], forced=[pg.tokens[:steps].tolist()]))
            out.append(streams.stacked(list(range(position + 1))))
        return out
    finally:
        engine.shutdown()


def explain(model: ModelRef | str, device: str, dtype: str, gs: G.GoldenSet, path: ParityPath, prompt: int,
            position: int) -> Explanation:
    """Compare the engine's residual stream with HF's at positions 0..position of golden prompt `prompt`."""
    pg = gs.prompts[prompt]
    ids = [int(t) for t in pg.prompt_ids] + [int(t) for t in pg.tokens]
    position = min(position, len(ids) - 2)  # the last golden token is never an input
    ids = ids[: max(position, len(pg.prompt_ids) - 1) + 1]  # the engine prefills the whole prompt
    n = position + 1  # the positions compared

    def run(hf: torch.nn.Module, inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        streams, before = hf_streams(hf, ids, device, inputs)
        return streams[:, :, :n], before

    hf = G.hf_model(model, device, torch.float32)
    ref, ref_in = run(hf)
    inputs = ref_in.to(getattr(torch, dtype)).float()  # each layer's input as every run alone gets it
    ref_alone = _updates(run(hf, inputs)[0], inputs[:, :n])
    del hf
    eng, eng_alone = engine_streams(model, device, dtype, gs, path, prompt, position, [None, inputs])
    half = dtype != "float32"
    spread, spread_alone = None, None
    for attn in ("sdpa", "eager") if half else ("eager",):
        hf = G.hf_model(model, device, getattr(torch, dtype), attn)
        spread = _larger(spread, _measure(run(hf)[0], ref))
        spread_alone = _larger(spread_alone, _measure(_updates(run(hf, inputs)[0], inputs[:, :n]), ref_alone))
        del hf
    kind = (f"HF {dtype} (sdpa and eager attention) against HF float32 sdpa, the larger: the rounding a correct "
            f"{dtype} implementation carries in every op" if half else
            "HF float32 eager against HF float32 sdpa: in fp32 HF's only difference from itself is its attention")
    err, alone = _measure(eng, ref), _measure(_updates(eng_alone, inputs[:, :n]), ref_alone)
    rows = [LayerRow(layer, name, float(err.median[layer, h]), float(spread.median[layer, h]),
                     float(alone.median[layer, h]), float(spread_alone.median[layer, h]), float(alone.at_n[layer, h]),
                     float(spread_alone.at_n[layer, h]), dtype)
            for layer in range(ref.shape[0]) for h, name in enumerate(HALVES)]
    return Explanation(name_of(model), device, dtype, path.name, prompt, position, kind, rows)


def format_explanation(e: Explanation) -> str:
    lines = [f"explain: {e.model} on {e.device} in {e.dtype}, path {e.path}, prompt {e.prompt}, positions "
             f"0..{e.position} (the failing one and every one before it); relative errors against HF float32 sdpa:",
             "  stream: the residual stream after the half, each run on its own: the median over the positions",
             "  alone:  every layer's input set to HF fp32's (rounded to the dtype): what the half adds, the median "
             "over the positions and at the failing one (N)",
             "  engine: the engine (teacher-forced, no CUDA graphs)",
             f"  HF: {e.spread_kind}",
             f"  a half diverges where the engine alone exceeds max({FACTOR:g} x HF alone, {FLOOR[e.dtype]:g}), its "
             f"median or at N",
             f"  {'layer':>5}  {'half':<9}  {'stream':>9}  {'HF':>9}  {'alone':>9}  {'HF':>9}  {'alone@N':>9}  "
             f"{'HF':>9}"]
    for r in e.rows:
        lines.append(f"  {r.layer:>5}  {r.half:<9}  {r.stream:>9.3g}  {r.hf_stream:>9.3g}  {r.alone:>9.3g}  "
                     f"{r.hf_alone:>9.3g}  {r.alone_n:>9.3g}  {r.hf_alone_n:>9.3g}{'  <- diverges' * r.diverges}")
    first = e.first
    lines.append(f"first diverging layer: {first.layer} ({first.half})" if first else
                 "first diverging layer: none (every layer alone is within HF's own spread: the layers show no "
                 "fault; not measured here are the embedding, the final norm and the LM head, what runs only under "
                 "CUDA graphs, and the prompt's company in its batch: it ran alone here)")
    return "\n".join(lines)


def explain_failure(result: ParityResult, gs: G.GoldenSet, model: ModelRef | str | None = None) -> str:
    """--explain on a failing ParityResult: its first failure's prompt and position, along its path; model: the
    folder it was run on (default: the zoo's model of result.model)."""
    f = first_failure(result)
    path = next(p for p in PATHS if p.name == f.path)
    return format_explanation(explain(model or result.model, result.device, result.dtype, gs, path, f.prompt, f.position))
