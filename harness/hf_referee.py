"""Float64 is the referee of HF's own runs: what of them a golden's tolerance may take, and where HF is wrong.

A golden records, at every golden position (harness.golden_reference), how far each of HF's runs lies from HF in
float64: the golden's own rows (reference_err) and HF's other settings (variant_err: sdpa and eager attention, thread
counts), and how far each setting lies from the golden's rows (spread_err). Correct implementations differ by
rounding, and their distances to the exact result are alike; one whose distance is far beyond the others' is a bug,
and a spread it makes is the bug's size, not a tolerance. The rule, at every position away from router near ties
(where two correct runs may route apart):

- c(p): the smallest of the implementations' distances to float64 at p, HF's best there: any number of them may be
  off at p (every sdpa setting shares one attention kernel) as long as one is not;
- M, the largest c(p) over the golden's positions: how far HF's best comes from exact arithmetic on this model in this
  dtype, at its worst position;
- an implementation is off at p when its distance to float64 there exceeds OFF_FACTOR x M. A setting whose own
  distance was not measured (float64 run on another host than the setting) is judged by what the triangle inequality
  gives: at least its spread minus the golden's distance.

OFF_FACTOR = 4: on the eight committed CPU goldens (fp32, the golden's rows and four settings each) no implementation's
largest distance exceeds 2.05 M (gemma3-270m's rows, made on another host than its settings; 1.67 M at most on the
others), and HF bf16 on the CPU (tiny-qwen3, tiny-gemma3, two settings) 1.42 M; the bug that made this rule (HF eager
on an H200 at one position of tiny-gemma3's fp32 golden) lies 75.7 nats from the golden where M is 2e-4.

What is off is recorded (provenance hf_off) and said by golden and parity, and left out: HF's spread keeps at each
position the settings that agree with float64 there (none where the golden's own row is off), HF's distance to float64
the implementations that agree. Parity does not judge a position where the golden's own row is off: it is not HF's
answer there.

The bound (tests/test_golden_referee.py holds every committed golden to it): with A the largest distance to float64 of
an agreeing implementation, two of them differ by at most 2A on the same ids (triangle inequality), so parity's
tol = 4 x max(HF's spread, A) <= 8A.

A golden made before the per-setting records (no hf_variants) holds the golden's distance to float64 at each position
but its spread only as a distribution: there a largest spread beyond (1 + OFF_FACTOR) x A is refuted as a whole (the
setting lies at least spread - A from float64, beyond OFF_FACTOR x A), its positions unknown (refuted_summary).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List

import numpy as np

from harness.golden_files import GoldenSet
from harness.hf_runs import spread_summary

OFF_FACTOR = 4.0
GOLDEN = "the golden's own run"  # how hf_off names the run whose rows the golden holds
LARGEST_SHOWN = 20  # the off positions hf_off lists by name (all of them are counted)


@dataclass
class Off:
    """An implementation off at a golden position."""

    prompt: str
    position: int
    implementation: str  # a name of hf_variants, or GOLDEN
    float64_err: float  # its distance to float64 there (for a setting not measured: its lower bound)
    golden_float64_err: float  # the golden's own distance there


@dataclass
class Verdict:
    """HF's spread and its distance to float64 over what agrees with float64 (routed: away from router near ties, MoE
    models), and what does not. nearest_max (M) and bound (OFF_FACTOR x M): None where float64 was not measured."""

    spread: Dict[str, Any] | None
    reference: Dict[str, Any] | None
    spread_routed: Dict[str, Any] | None = None
    reference_routed: Dict[str, Any] | None = None
    off: List[Off] = field(default_factory=list)
    nearest_max: float | None = None
    bound: float | None = None

    def golden_off(self) -> Dict[str, List[int]]:
        """Per prompt, the positions where the golden's own row is off (parity leaves them out)."""
        out: Dict[str, List[int]] = {}
        for o in self.off:
            if o.implementation == GOLDEN:
                out.setdefault(o.prompt, []).append(o.position)
        return out

    def record(self) -> Dict[str, Any]:
        """provenance hf_off: the rule's scale, every off position counted, the golden's own listed in full (parity
        reads them), the largest LARGEST_SHOWN by name."""
        counts: Dict[str, int] = {}
        for o in self.off:
            counts[o.implementation] = counts.get(o.implementation, 0) + 1
        largest = sorted(self.off, key=lambda o: -o.float64_err)[:LARGEST_SHOWN]
        return {"nearest_max": self.nearest_max, "off_factor": OFF_FACTOR, "bound": self.bound, "counts": counts,
                "golden": self.golden_off(), "largest": [asdict(o) for o in largest]}


def _as_rows(a: np.ndarray | None, rows: int, n: int) -> np.ndarray:
    """A recorded array as [rows, n] float64; NaN (not measured) where the golden has none."""
    return np.full((rows, n), np.nan) if a is None else a.astype(np.float64).reshape(rows, n)


def _largest(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """[I, n] -> [n]: at each position the largest of the kept, measured values; NaN where there is none."""
    out = np.where(keep & ~np.isnan(values), values, -np.inf).max(axis=0, initial=-np.inf)
    return np.where(np.isfinite(out), out, np.nan)


def _stats(err: List[np.ndarray], kl: List[np.ndarray], keep: List[np.ndarray] | None = None,
           extra: Dict[str, Any] | None = None) -> Dict[str, Any] | None:
    """The distribution over every position with a value (and kept); None where there is none."""
    e, k = np.concatenate(err), np.concatenate(kl)
    m = ~np.isnan(e) & (np.concatenate(keep) if keep is not None else True)
    return dict(spread_summary(e[m], k[m]), **(extra or {})) if m.any() else None


def judge(gs: GoldenSet, router_tie: float | None = None) -> Verdict:
    """The verdict on a golden's recorded runs (harness.golden_reference); router_tie: a MoE model's near-tie margin,
    for the routed statistics."""
    variants = gs.provenance.get("hf_variants", [])
    per_prompt = []
    for pg in gs.prompts:
        n = len(pg.prompt_ids) + len(pg.tokens) - 1
        ref = [_as_rows(a, 1, n) for a in (pg.reference_err, pg.reference_kl)]  # the golden's own
        var = [_as_rows(a, len(variants), n) for a in (pg.variant_err, pg.variant_kl)]
        spread = [_as_rows(a, len(variants), n) for a in (pg.spread_err, pg.spread_kl)]
        tied = np.zeros(n, bool) if pg.router_near_tie is None else pg.router_near_tie.astype(bool)
        # every implementation's distance to float64, the golden's first: measured, else the triangle's lower bound
        measured = np.vstack([ref[0], var[0]])
        d = np.where(np.isnan(measured), np.vstack([ref[0], np.maximum(spread[0] - ref[0], 0.0)]), measured)
        per_prompt.append((pg.name, (measured, np.vstack([ref[1], var[1]])), spread, tied, d))
    best = np.concatenate([np.fmin.reduce(d, axis=0)[~tied] for *_, tied, d in per_prompt])  # c(p)
    m = float(np.nanmax(best)) if any(not np.isnan(d[0]).all() for *_, d in per_prompt) else None
    bound = None if m is None else OFF_FACTOR * m
    off: List[Off] = []
    s_err, s_kl, r_err, r_kl, routed = [], [], [], [], []
    for name, dist, spread, tied, d in per_prompt:
        bad = np.zeros(d.shape, bool) if bound is None else (d > bound) & ~tied
        off += [Off(name, int(pos), GOLDEN if i == 0 else variants[i - 1], float(d[i, pos]), float(d[0, pos]))
                for i, pos in zip(*np.nonzero(bad))]
        agree = ~bad[1:] & ~bad[0]  # a setting's spread counts where it and the golden's own row agree
        s_err.append(_largest(spread[0], agree))
        s_kl.append(_largest(spread[1], agree))
        r_err.append(_largest(dist[0], ~bad))  # measured distances only, never the lower bounds
        r_kl.append(_largest(dist[1], ~bad))
        routed.append(~tied)
    verdict = Verdict(_stats(s_err, s_kl), _stats(r_err, r_kl), off=off, nearest_max=m, bound=bound)
    if router_tie is not None:
        extra = {"router_tie": router_tie, "near_tie_positions": int(sum((~r).sum() for r in routed))}
        verdict.spread_routed = _stats(s_err, s_kl, routed, extra)
        verdict.reference_routed = _stats(r_err, r_kl, routed, extra)
    return verdict


def refuted_summary(prov: Dict[str, Any], spread: Dict[str, Any], reference: Dict[str, Any] | None) -> str:
    """For a golden without per-setting records: why its recorded spread (a distribution) is refuted by float64 as a
    whole, or "" where it is not (or cannot be judged)."""
    if "hf_variants" in prov or reference is None or "err_max" not in spread:
        return ""
    s, a = float(spread["err_max"]), float(reference["err_max"])
    if s <= (1 + OFF_FACTOR) * a:
        return ""
    return (f"HF's kernel spread {s:.3g} is refuted by float64: the golden's own rows lie within {a:.3g} of float64 at "
            f"every position, so the setting that differs from them by {s:.3g} lies at least {s - a:.3g} from it, "
            f"beyond {OFF_FACTOR:g} x {a:.3g}; that setting is off, the golden does not record where")


def findings(prov: Dict[str, Any]) -> List[str]:
    """What a golden's provenance says of HF's own bugs, a line each (none when HF agrees with float64)."""
    largest = (prov.get("hf_spread") or {}).get("err_max", prov.get("hf_spread_max_abs_logprob"))
    refuted = "" if largest is None else refuted_summary(prov, {"err_max": largest}, prov.get("hf_reference"))
    if refuted:
        return [f"{refuted}; measure HF's settings per position on that device to find where: python -m harness golden "
                f"--refresh-spread --model {prov['model']} --device {prov['device_type']} --dtype {prov['dtype']}"]
    rec = prov.get("hf_off")
    if not rec or not rec.get("counts"):
        return []
    lines = [f"float64 refutes HF at {n} position{'s' if n > 1 else ''} ({impl}): its distance to float64 exceeds "
             f"{rec['off_factor']:g} x {rec['nearest_max']:.3g}, the farthest HF's nearest implementation lies from "
             f"it at any position"
             for impl, n in rec["counts"].items()]
    for o in rec["largest"][:3]:
        lines.append(f"  {o['implementation']} at prompt {o['prompt']!r} position {o['position']}: "
                     f"{o['float64_err']:.3g} from float64 (the golden's rows {o['golden_float64_err']:.3g})")
    return lines
