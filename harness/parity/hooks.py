"""The residual stream after each layer's attention and after its MLP, captured by forward hooks on the engine's
decoder layers and on HF's, as [layers, 2 (attention, mlp), positions, hidden] float32 on the CPU.

Engine (engine.models.decoder.DecoderLayer): a layer returns (x, residual), its MLP's output not yet added; residual
is then the stream after the attention (added in by the MLP's norm) and x + residual the stream after the MLP (added
in the model dtype, as the next layer's norm and HF add it). The fused ops add in place into those tensors later, so
each is copied when the hook runs.
HF: a layer's output is the stream after its MLP; the input of the norm before its MLP (post_attention_layernorm, or
a sandwich-norm model's pre_feedforward_layernorm) is the stream after its attention.

Given `inputs` [layers, positions, hidden] (HF fp32's stream before each layer), each layer's input is replaced by
it (rounded to the model's dtype), so that each layer is measured alone: its own error, not the sum of the errors of
the layers before it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import torch

from engine.core import get_global_ctx

HALVES = ("attention", "mlp")


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", torch.float32, copy=True)


class EngineStreams:
    """Per layer and half, the stream's row at each absolute position the engine computed (one request per run)."""

    def __init__(self, layers: List[torch.nn.Module], inputs: torch.Tensor | None = None) -> None:
        self.layers, self.inputs = layers, inputs
        self.rows: List[List[Dict[int, torch.Tensor]]] = [[{}, {}] for _ in layers]

    @contextmanager
    def capture(self) -> Iterator["EngineStreams"]:
        handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]
        if self.inputs is not None:
            handles += [layer.register_forward_pre_hook(self._replace(i)) for i, layer in enumerate(self.layers)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, i: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: tuple) -> None:
            x, residual = output
            positions = get_global_ctx().batch.positions.tolist()
            for half, stream in enumerate((_copy(residual), _copy(x + residual))):
                self.rows[i][half].update(zip(positions, stream[: len(positions)]))
        return hook

    def _replace(self, i: int) -> Any:
        def pre_hook(module: torch.nn.Module, args: tuple) -> tuple:
            positions = get_global_ctx().batch.positions.long().cpu()
            # residual None: the layer takes x as the whole stream, as the first layer does
            return self.inputs[i][positions].to(args[0].device, args[0].dtype), None
        return pre_hook

    def stacked(self, positions: List[int]) -> torch.Tensor:
        """[layers, 2, len(positions), hidden]; every position must have been computed."""
        return torch.stack([torch.stack([torch.stack([half[p] for p in positions]) for half in layer])
                            for layer in self.rows])


@torch.inference_mode()
def hf_streams(hf: Any, ids: List[int], device: str,
               inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One HF forward over ids with hooks on every decoder layer: the streams [layers, 2, len(ids), hidden] after
    each layer's attention and MLP, and each layer's input [layers, len(ids), hidden] (replaced by `inputs`)."""
    layers = hf.model.layers
    out: List[List[torch.Tensor | None]] = [[None, None, None] for _ in layers]  # before, attention, mlp
    handles = []
    for i, layer in enumerate(layers):
        norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm

        def before_layer(module: Any, args: tuple, i: int = i) -> tuple | None:
            if inputs is not None:
                args = (inputs[i][None].to(args[0].device, args[0].dtype),) + args[1:]
            out[i][0] = _copy(args[0][0])
            return args if inputs is not None else None

        def before_mlp(module: Any, args: tuple, i: int = i) -> None:
            out[i][1] = _copy(args[0][0])

        def after_layer(module: Any, args: tuple, output: Any, i: int = i) -> None:
            out[i][2] = _copy((output[0] if isinstance(output, tuple) else output)[0])

        handles += [layer.register_forward_pre_hook(before_layer), norm.register_forward_pre_hook(before_mlp),
                    layer.register_forward_hook(after_layer)]
    try:
        hf(torch.tensor([ids], device=device))
    finally:
        for h in handles:
            h.remove()
    return (torch.stack([torch.stack(o[1:]) for o in out]),  # type: ignore[misc]
            torch.stack([o[0] for o in out]))  # type: ignore[misc]
