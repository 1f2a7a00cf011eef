"""How a kernel's output is judged: its error and the reference's, both against the exact result, and the verdict.

The engine's reference (the torch backend, the torch ops) and the fast kernel run on identical bf16 inputs; the exact
result is computed in float64 from those same bf16-rounded inputs (harness/components/reference.py), so neither side
is blamed for the rounding of its inputs. Each output gets the max and mean absolute error of the kernel, of the
reference and of the bare rounding of the exact result to bf16 (the least error any bf16 output can have).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Literal

import torch

ERROR_FACTOR = 3.0
"""A kernel passes when its max and its mean abs error are each at most ERROR_FACTOR x the reference's on the same
inputs. Why 3: both outputs end in one rounding to bf16 (error up to 1/2 ulp, 1/4 ulp on average); a fused or tiled
kernel may add one more rounding of about the same size on the way (FlashInfer rounds the softmax weights to bf16
before P.V, the reference attends in fp32), which at worst doubles the max (1/2 + 1/2 ulp) and raises the mean by
less (two independent errors add in quadrature: about sqrt(2); a float64 emulation of both numerics gives 1.0-1.2
for the max and 1.1-1.6 for the mean). 3 leaves half again over that worst case. A systematic relative error of 1%
is 2.6 bf16 ulps at every element, about ten times the reference's mean error, so a fault of that size cannot hide
under the factor (tests/test_components.py shows it for a 1% softmax scale in decode attention)."""

FaultKind = Literal["softmax_scale", "kv_slot", "output_scale", "rope_base"]
FAULT_KINDS = ("softmax_scale", "kv_slot", "output_scale", "rope_base")


@dataclass(frozen=True)
class Fault:
    """An error of size e planted in the kernel under test only (the reference and the exact result never see it).

    softmax_scale: the attention backend under test is built with the softmax scale x (1 + e);
    kv_slot: a fraction e of the step's tokens (at least one when e > 0) is written one position early, over the
             slot of the token before it (the kernel side's positions and out_loc both name the wrong slot);
    output_scale: an op's outputs are multiplied by (1 + e) right after the kernel;
    rope_base: the fused RoPE kernel reads a cos/sin table built with the base x (1 + e).
    """

    kind: FaultKind
    e: float

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose one of: {', '.join(FAULT_KINDS)}")
        if not math.isfinite(self.e) or self.e < 0.0 or (self.kind == "kv_slot" and self.e > 1.0):
            raise ValueError(f"fault size e must be finite and >= 0 (a fraction <= 1 for kv_slot), got {self.e}")


def planted(fault: Fault | None, kind: FaultKind) -> float:
    """The size of `fault` if it is of this kind, else 0."""
    return fault.e if fault is not None and fault.kind == kind else 0.0


def check_fault(fault: Fault | None, allowed: tuple, check: str) -> None:
    if fault is not None and fault.kind not in allowed:
        raise ValueError(f"the {check} check cannot plant a {fault.kind!r} fault; it plants: {', '.join(allowed)}")


def _ratio(num: float, den: float) -> float:
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


@dataclass(frozen=True)
class Errors:
    """Absolute errors of one output against the exact result."""

    kernel_max: float
    kernel_mean: float
    torch_max: float  # the engine's reference (torch bf16) on the same inputs
    torch_mean: float
    rounding_max: float  # the exact result rounded to bf16: the floor of any bf16 output
    rounding_mean: float

    @property
    def ratio_max(self) -> float:
        return _ratio(self.kernel_max, self.torch_max)

    @property
    def ratio_mean(self) -> float:
        return _ratio(self.kernel_mean, self.torch_mean)

    @property
    def ratio(self) -> float:
        """The larger of the two ratios: what the verdict compares with ERROR_FACTOR."""
        return max(self.ratio_max, self.ratio_mean)

    @property
    def passed(self) -> bool:
        return self.ratio <= ERROR_FACTOR


def measure(kernel: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor) -> Errors:
    """kernel and reference outputs (any dtype, the same shape as exact) against the float64 exact result."""
    assert kernel.shape == reference.shape == exact.shape, (kernel.shape, reference.shape, exact.shape)
    exact = exact.double()
    stats = []
    for out in (kernel, reference, exact.to(kernel.dtype)):
        err = (out.double() - exact).abs()
        stats += [float(err.max()), float(err.mean())]
    return Errors(*stats)


@dataclass
class CheckResult:
    """One component check of one case: per output its errors (numeric checks) or its count of differing elements
    (exact checks: the KV append, what an in-place op must leave alone)."""

    check: str  # attention, kv_append, or the op's name
    case: str
    fault: Fault | None = None
    errors: Dict[str, Errors] = field(default_factory=dict)
    mismatches: Dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.errors.values()) and not any(self.mismatches.values())

    @property
    def worst_ratio(self) -> float:
        """The largest kernel / reference error ratio over the outputs (0 for an exact check)."""
        return max((e.ratio for e in self.errors.values()), default=0.0)

    def describe(self) -> str:
        planted_ = "" if self.fault is None else f" with {self.fault.kind} fault e={self.fault.e:g}"
        lines = [f"{self.check} {self.case}{planted_}: {'pass' if self.passed else 'FAIL'}"
                 f" (bound: kernel error <= {ERROR_FACTOR:g} x the reference's)"]
        for name, e in self.errors.items():
            lines.append(f"  {name}: kernel max {e.kernel_max:.3e} mean {e.kernel_mean:.3e} | torch max "
                         f"{e.torch_max:.3e} mean {e.torch_mean:.3e} | rounding max {e.rounding_max:.3e} mean "
                         f"{e.rounding_mean:.3e} | ratio max {e.ratio_max:.2f} mean {e.ratio_mean:.2f}")
        for name, n in self.mismatches.items():
            lines.append(f"  {name}: {n} elements differ (must be bitwise equal)")
        return "\n".join(lines)
