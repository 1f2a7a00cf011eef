"""HF's runs measured against exact arithmetic and against the golden: what the gate's tolerance is made of.

HF's spread between its own settings (sdpa against eager attention, thread counts) measures one kernel's rounding. A
model with large activations (random-init test models, long prompts, deep stacks) carries far more rounding than that
in every GEMM and norm: there HF fp32 lies up to 14x further from exact arithmetic than from its own eager attention.
So every golden position is measured with parity's own measure (harness.compare.compare_row on the golden's top-K
ids: err = max |logprob difference|, KL with a rest bucket), teacher-forced on the golden's sequences:

- the golden's own rows against HF float64 on the CPU (the same weights upcast, which is exact): reference_err / _kl;
- each of HF's settings a user may run, on the golden's device (sdpa and eager attention; on the CPU at 1, 2 and all
  cores' threads), against float64 (variant_err / _kl) and against the golden's rows (spread_err / _kl).

Float64 is the referee (harness.hf_referee): a setting far further from it than HF's implementations agree on is off
there, recorded and reported, and left out of what the tolerance takes. The gate (harness.parity.gate.own_spread)
takes HF's own spread, statistic by statistic, as the larger of the agreeing spread and distance to float64. Why a
factor of it bounds a correct engine: with x the exact result, |engine - golden| <= |engine - x| + |golden - x|, and
an engine as accurate as HF has |engine - x| about |golden - x|.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Tuple

import numpy as np
import torch

from harness import progress
from harness import hf_referee
from harness.compare import ROUTER_TIE, compare_row
from harness.golden_files import GoldenSet, golden_dir, load, load_checked, save
from harness.hf_runs import at_threads, hf_model, router_margins, spread_threads
from harness.models import ModelRef
from harness.report import device_name, provenance

REFERENCE_DEFINITION = (
    "per golden position (prompt positions, then the continuation's), teacher-forced on the golden's sequences, on the "
    "golden's top-K ids with parity's measure: max |logprob difference| ('err'), KL with a rest bucket ('kl'); against "
    "HF float64 on the CPU (the golden's weights upcast exactly, sdpa attention): the golden's own rows (golden.npz "
    "reference_err / _kl) and each of HF's settings in hf_variants (variant_err / _kl); the distribution here is a "
    "position's largest over the implementations that agree with float64 there (hf_off)")
SPREAD_DEFINITION = (
    "per golden position, each of HF's settings in hf_variants (sdpa and eager attention on the golden's device; on "
    "the CPU at 1, 2 and all cores' threads) against the golden's rows, with the same measure (golden.npz spread_err / "
    "_kl); the distribution here is a position's largest over the settings that agree with float64 there, where the "
    "golden's own row does (hf_off)")
ROUTED_DEFINITION = "mixture-of-experts models: the same over the positions where no run has a router near tie"
OFF_DEFINITION = ("float64 is the referee (harness/hf_referee.py): an implementation is off at a position where its "
                  "distance to float64 exceeds off_factor x nearest_max, the largest over the golden's positions of "
                  "the smallest of the implementations' distances there (router near ties not judged); counts per "
                  "implementation, the golden's own off positions per prompt (parity does not judge them), the "
                  "largest by name")
HEADROOM = 1.3  # the float64 run's peak over its weights: activations, logits over the vocabulary, the allocator


@dataclass
class Runs:
    """Per prompt, at each golden position: the golden's rows against float64 (None: not measured, unmeasured says
    why), and each setting of `variants` against float64 (NaN where float64 was not measured) and against the
    golden's rows; near_tie: a router near tie in any run (MoE models), golden_ties: in the golden's own setting's."""

    variants: List[str]
    ref: List[Tuple[np.ndarray, np.ndarray]] | None
    var: List[Tuple[np.ndarray, np.ndarray]]  # [V, n] err, kl
    spread: List[Tuple[np.ndarray, np.ndarray]]
    near_tie: List[np.ndarray] | None
    golden_ties: List[List[int]] | None
    device: str | None  # where the settings ran
    seconds: float
    unmeasured: str = ""


def float64_bytes(model: ModelRef) -> int:
    """What the float64 copy of the model's weights takes: 8 bytes a parameter, read from the safetensors headers."""
    from safetensors import safe_open

    params = 0
    for f in sorted(model.folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            params += sum(int(np.prod(st.get_slice(k).get_shape())) for k in st.keys())
    return 8 * params


def available_bytes() -> int:
    """The host memory a new allocation can take now (MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62  # not Linux: assume it fits, as torch would


def _sequence(pg: Any) -> List[int]:
    return [int(t) for t in pg.prompt_ids] + [int(t) for t in pg.tokens]


def _golden_rows(pg: Any) -> tuple[np.ndarray, np.ndarray]:
    """[P + T - 1, K] ids and logprobs: the golden's row at every position it has one (decode row 0 repeats the
    prefill's last)."""
    return np.concatenate([pg.prefill_ids, pg.decode_ids[1:]]), np.concatenate([pg.prefill_lp, pg.decode_lp[1:]])


def _at_ids(model: Any, seq: List[int], ids: np.ndarray, tie: float | None, device: str = "cpu",
            threads: int | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """Log-probabilities [n, K] (float64) on the golden's ids at its n positions, run at `threads`, and for a MoE model
    (tie: its near-tie margin in the golden's dtype) whether each position's smallest router margin is a near tie."""
    moe = tie is not None
    out = at_threads(model, threads, torch.tensor([seq], device=device), {"output_router_logits": True} if moe else {})
    logits = out.logits[0, : len(ids)]
    lp = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), -1)
    at = lp.gather(1, torch.from_numpy(ids.astype(np.int64)).to(lp.device)).double().cpu()
    near = router_margins(out, len(seq), model.config.num_experts_per_tok)[: len(ids)] <= tie if moe else \
        np.zeros(len(ids), bool)
    return at, near


def _measure(a: torch.Tensor, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """err and KL per position of log-probabilities a [n, K] against b [n, K], both on the same ids."""
    stats = [compare_row(a[pos], np.arange(b.shape[1]), b[pos]) for pos in range(len(b))]
    return np.array([s.err for s in stats]), np.array([s.kl for s in stats])


def settings(device: str) -> List[tuple[str, int | None, str]]:
    """HF's settings a user may run on the device: (attention, threads, name)."""
    def name(attn: str, t: int | None) -> str:
        return attn if t is None else f"{attn}, {t} thread{'s' if t > 1 else ''}"

    return [(attn, t, name(attn, t)) for attn in ("sdpa", "eager") for t in spread_threads(device)]


@torch.inference_mode()
def measure(model: ModelRef, gs: GoldenSet, device: str | None) -> Runs:
    """Every golden position: the golden's rows against float64, and HF's settings on `device` (None: none, for a
    golden of another device than this host's) against float64 and the golden's rows. One model in memory at a time:
    the float64 run keeps its log-probabilities on the golden's ids only."""
    clock = progress.Stopwatch()
    dtype = gs.provenance["dtype"]
    tie = ROUTER_TIE[dtype] if model.is_moe else None
    rows = [_golden_rows(pg) for pg in gs.prompts]
    near = [np.zeros(len(ids), bool) for ids, _ in rows]
    for u, pg in enumerate(gs.prompts):  # the golden's own near ties, as recorded
        near[u][[p for p in gs.provenance.get("hf_router_near_ties", {}).get(pg.name, ()) if p < len(near[u])]] = True
    need, have = int(HEADROOM * float64_bytes(model)), available_bytes()
    exact, unmeasured = None, ""
    if need > have:
        unmeasured = (f"the float64 copy needs about {need / 2**30:.0f} GiB and this host has {have / 2**30:.0f} GiB "
                      "free; the tolerance follows HF's kernel spread alone")
    else:
        hf = hf_model(model, "cpu", torch.float64)
        exact = []
        for u, pg in enumerate(progress.bar(gs.prompts, desc=f"float64 reference {model.name} {dtype}")):
            x, tied = _at_ids(hf, _sequence(pg), rows[u][0], tie)
            near[u] |= tied
            exact.append(x)
        del hf
    ref = None if exact is None else [_measure(x, lp) for x, (_, lp) in zip(exact, rows)]
    chosen = settings(device) if device is not None else []
    var = [(np.full((len(chosen), len(ids)), np.nan), np.full((len(chosen), len(ids)), np.nan)) for ids, _ in rows]
    spread = [(np.zeros((len(chosen), len(ids))), np.zeros((len(chosen), len(ids)))) for ids, _ in rows]
    own = torch.get_num_threads() if device == "cpu" else None
    golden_ties = None
    for attn in dict.fromkeys(a for a, _, _ in chosen):
        hf = hf_model(model, device, getattr(torch, dtype), attn)
        for v, (a, threads, _) in enumerate(chosen):
            if a != attn:
                continue
            ties_here = []
            for u, pg in enumerate(progress.bar(gs.prompts, desc=f"HF {attn} {threads or ''} {model.name} {dtype}")):
                y, tied = _at_ids(hf, _sequence(pg), rows[u][0], tie, device, threads)
                near[u] |= tied
                ties_here.append([int(p) for p in np.nonzero(tied)[0]])
                spread[u][0][v], spread[u][1][v] = _measure(y, rows[u][1])
                if exact is not None:
                    var[u][0][v], var[u][1][v] = _measure(y, exact[u].numpy())
            if attn == "sdpa" and threads == own:
                golden_ties = ties_here  # the golden's own setting, run again: its near ties
        del hf
    return Runs([n for _, _, n in chosen], ref, var, spread, near if tie is not None else None,
                golden_ties if tie is not None else None, device, clock.lap(), unmeasured)


def _merge(old: np.ndarray | None, old_names: List[str], new: np.ndarray, names: List[str]) -> np.ndarray:
    """[V', n] over the union of the settings: a setting measured before and now keeps, position by position, the
    larger (a spread measured on another machine adds HF's variation there, it does not replace what was seen)."""
    union = old_names + [n for n in names if n not in old_names]
    out = np.full((len(union), new.shape[1]), np.nan)
    if old is not None:
        out[: len(old_names)] = old
    for i, name in enumerate(names):
        j = union.index(name)
        out[j] = np.fmax(out[j], new[i])
    return out.astype(np.float32)


def attach(gs: GoldenSet, runs: Runs, command: str) -> hf_referee.Verdict:
    """Write the runs into the golden's arrays (merged with what it recorded, setting by setting) and the referee's
    verdict on all of it into its provenance; returns the verdict."""
    old_names = list(gs.provenance.get("hf_variants", []))
    names = old_names + [n for n in runs.variants if n not in old_names]
    for u, pg in enumerate(gs.prompts):
        if runs.ref is not None:
            pg.reference_err, pg.reference_kl = (a.astype(np.float32) for a in runs.ref[u])
        if runs.variants:
            pg.variant_err = _merge(pg.variant_err, old_names, runs.var[u][0], runs.variants)
            pg.variant_kl = _merge(pg.variant_kl, old_names, runs.var[u][1], runs.variants)
            pg.spread_err = _merge(pg.spread_err, old_names, runs.spread[u][0], runs.variants)
            pg.spread_kl = _merge(pg.spread_kl, old_names, runs.spread[u][1], runs.variants)
        if runs.near_tie is not None:
            pg.router_near_tie = runs.near_tie[u] | (False if pg.router_near_tie is None else pg.router_near_tie)
    prov, here = gs.provenance, provenance("cpu")
    if names:
        prov["hf_variants"] = names
    if runs.golden_ties is not None:
        prov["hf_router_near_ties"] = {pg.name: t for pg, t in zip(gs.prompts, runs.golden_ties)}
    dtype = prov["dtype"]
    verdict = hf_referee.judge(gs, ROUTER_TIE[dtype] if runs.near_tie is not None else None)
    if verdict.spread is not None:  # none where no setting was ever measured per position (an older golden)
        prov.update(hf_spread=verdict.spread, hf_spread_max_abs_logprob=verdict.spread["err_max"],
                    hf_spread_definition=SPREAD_DEFINITION)
        if verdict.spread_routed is not None:
            prov.update(hf_spread_routed=verdict.spread_routed, hf_spread_routed_definition=ROUTED_DEFINITION)
    if runs.variants:  # the machines and thread counts the per-setting records cover (an older record's are gone)
        threads = sorted({t for _, t, n in settings(runs.device) if t is not None})
        before = {k: set(prov.get(k, [])) if old_names else set() for k in ("hf_spread_threads", "hf_spread_devices")}
        if threads:
            prov["hf_spread_threads"] = sorted(before["hf_spread_threads"] | set(threads))
        prov["hf_spread_devices"] = sorted(before["hf_spread_devices"] | {device_name(runs.device)})
        prov["hf_spread_measured"] = here["date"]
    for key in [k for k in prov if k.startswith("hf_reference") or k in ("hf_off", "hf_off_definition")]:
        del prov[key]  # a float64 measurement replaces the one before it whole
    if runs.ref is None:
        prov.update(hf_reference_unmeasured=runs.unmeasured, hf_reference_measured=here["date"],
                    hf_reference_command=command)
        return verdict
    prov.update(hf_reference=verdict.reference, hf_reference_definition=REFERENCE_DEFINITION,
                hf_reference_measured=here["date"], hf_reference_device=here["device_name"],
                hf_reference_torch=torch.__version__, hf_reference_seconds=round(runs.seconds, 1),
                hf_reference_command=command)
    if verdict.reference_routed is not None:
        prov.update(hf_reference_routed=verdict.reference_routed, hf_reference_routed_definition=ROUTED_DEFINITION)
    if verdict.bound is not None:
        prov.update(hf_off=verdict.record(), hf_off_definition=OFF_DEFINITION)
    return verdict


def remeasure(model: ModelRef, device_type: str, dtype: str, device: str | None, command: str,
              root: Path | None = None) -> hf_referee.Verdict:
    """Measure HF's runs again on a committed golden (its rows and tokens stay) and rewrite its records: float64 on
    this host, HF's settings on `device` (None: float64 alone, for a golden of another device than this host has)."""
    from harness.golden_files import GoldenError

    folder = golden_dir(model, device_type, dtype, root)
    if device_type == "cpu":
        gs = load_checked(model, device_type, dtype, root)
    else:  # another machine's golden: its tokenizer files may differ byte for byte; the runs need its weights
        gs = load(folder)
        if gs.provenance.get("weights_sha256") != model.weights_sha256():
            raise GoldenError(f"golden {folder} was made from other weights than {model.folder}'s; HF's runs must "
                              f"be measured on the golden's own weights")
    verdict = attach(gs, measure(model, gs, device), command)
    save(gs, folder)
    return verdict
