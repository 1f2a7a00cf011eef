"""HF's distance to exact arithmetic: the rounding any correct implementation in the golden's dtype carries.

HF's spread between its own kernels (sdpa against eager attention, thread counts) measures one kernel's rounding. A
model with large activations (random-init test models, long prompts, deep stacks) carries far more rounding than that
in every GEMM and norm: there HF fp32 lies up to 14x further from exact arithmetic than from its own eager attention.
So the golden also records how far HF in the golden's dtype lies from HF in float64 on the CPU (the same weights
upcast, which is exact), teacher-forced on the golden's sequences, at every golden position, with parity's own
measure (harness.compare.compare_row on the golden's top-K ids): err = max |logprob difference|, KL(golden || float64)
with a rest bucket. A position's value is the largest over the golden's own log-probabilities and, where the golden's
device is this process's (the CPU), HF's other settings a user may run: eager attention, and sdpa and eager at 1, 2
and all cores' threads (harness.golden.spread_threads).

The gate (harness.parity.gate.own_spread) takes HF's own spread, statistic by statistic, as the larger of this and the
kernel spread. Why a factor of it bounds a correct engine: with x the exact result, |engine - golden| <= |engine - x| +
|golden - x|, and an engine as accurate as HF has |engine - x| about |golden - x|.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Set

import numpy as np
import torch

from harness import progress
from harness.compare import ROUTER_TIE, compare_row
from harness.golden_files import GoldenSet, golden_dir, load_checked, save
from harness.hf_runs import at_threads, hf_model, router_margins, spread_summary, spread_threads
from harness.models import ModelRef
from harness.report import provenance

REFERENCE_DEFINITION = (
    "per golden position (prompt positions, then the continuation's), HF in the golden's dtype against HF float64 on "
    "the CPU (the golden's weights upcast exactly, sdpa attention), teacher-forced on the golden's sequences, on the "
    "golden's top-K ids with parity's measure: max |logprob difference| ('err') and KL(golden || float64) with a rest "
    "bucket ('kl'); a position's value is the largest over the golden's own log-probabilities and, for a golden of "
    "this machine's device, HF sdpa and eager at 1, 2 and all cores' threads; per-position arrays in golden.npz "
    "(reference_err, reference_kl), their distribution here")
ROUTED_DEFINITION = ("mixture-of-experts models: the same distribution over the positions where neither the golden "
                     "(hf_router_near_ties) nor a run measured here has a router near tie")


@dataclass
class Reference:
    """Per prompt, each golden position's err and KL against float64; their distribution (routed: away from router
    near ties, MoE models only). unmeasured: why there is none (the float64 copy does not fit this host)."""

    errs: List[np.ndarray]
    kls: List[np.ndarray]
    stats: Dict[str, Any] | None
    routed: Dict[str, Any] | None
    threads: List[int] | None
    seconds: float
    unmeasured: str = ""


HEADROOM = 1.3  # the float64 run's peak over its weights: activations, logits over the vocabulary, the allocator


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


def _forward(model: Any, seq: List[int], tie: float | None, threads: int | None = None) -> tuple[torch.Tensor, Set[int]]:
    """Log-probabilities [len(seq), vocab] (float64 for the float64 model, else float32) at `threads`, and for a MoE
    model (tie: its near-tie margin in the golden's dtype) the positions whose smallest router margin is a near tie."""
    moe = tie is not None
    out = at_threads(model, threads, torch.tensor([seq]), {"output_router_logits": True} if moe else {})
    logits = out.logits[0]
    lp = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), -1)
    if not moe:
        return lp, set()
    margins = router_margins(out, len(seq), model.config.num_experts_per_tok)
    return lp, {int(p) for p in np.nonzero(margins <= tie)[0]}


@torch.inference_mode()
def measure(model: ModelRef, gs: GoldenSet, variants: bool) -> Reference:
    """HF's distance to float64 at every golden position; variants: also HF's other settings on this CPU (the
    golden's device is the CPU). One model in memory at a time: the float64 run keeps its log-probabilities on the
    golden's ids only, the variants are compared with those."""
    clock = progress.Stopwatch()
    need, have = int(HEADROOM * float64_bytes(model)), available_bytes()
    if need > have:
        why = (f"the float64 copy needs about {need / 2**30:.0f} GiB and this host has {have / 2**30:.0f} GiB free; "
               "the tolerance follows HF's kernel spread alone")
        return Reference([], [], None, None, None, clock.lap(), unmeasured=why)
    dtype, moe = gs.provenance["dtype"], model.is_moe
    tie = ROUTER_TIE[dtype] if moe else None
    rows = [_golden_rows(pg) for pg in gs.prompts]
    recorded = gs.provenance.get("hf_router_near_ties", {})
    ties: List[Set[int]] = [set(recorded.get(pg.name, ())) for pg in gs.prompts]
    exact = hf_model(model, "cpu", torch.float64)
    at_ids, errs, kls = [], [], []
    for pg, (ids, lp), tied in zip(progress.bar(gs.prompts, desc=f"float64 reference {model.name} {dtype}"), rows,
                                   ties):
        x, near = _forward(exact, _sequence(pg), tie)
        tied |= near
        x = torch.stack([x[pos][torch.from_numpy(ids[pos].astype(np.int64))] for pos in range(len(ids))])
        at_ids.append(x)  # [n, K]: float64 on the golden's ids, all the variants need
        # the golden's own log-probabilities against it (compare_row on the K ids: the row is already theirs)
        stats = [compare_row(x[pos], np.arange(len(ids[pos])), lp[pos]) for pos in range(len(ids))]
        errs.append(np.array([st.err for st in stats]))
        kls.append(np.array([st.kl for st in stats]))
    del exact
    # HF's other settings against float64 on the same ids; the golden's own run is sdpa at this thread count
    settings = [(attn, t) for attn in ("sdpa", "eager") for t in spread_threads("cpu")
                if not (attn == "sdpa" and t == torch.get_num_threads())] if variants else []
    for attn in dict.fromkeys(a for a, _ in settings):
        hf = hf_model(model, "cpu", getattr(torch, dtype), attn)
        for threads in [t for a, t in settings if a == attn]:
            for u, pg in enumerate(gs.prompts):
                y, near = _forward(hf, _sequence(pg), tie, threads)
                ties[u] |= near
                ids = rows[u][0]
                for pos in range(len(ids)):
                    st = compare_row(y[pos], ids[pos], at_ids[u][pos].numpy())
                    errs[u][pos], kls[u][pos] = max(errs[u][pos], st.err), max(kls[u][pos], st.kl)
        del hf
    errs, kls = [e.astype(np.float32) for e in errs], [k.astype(np.float32) for k in kls]  # as golden.npz keeps them
    flat_err, flat_kl = np.concatenate(errs), np.concatenate(kls)
    routed = None
    if moe:
        keep = np.concatenate([[pos not in tied for pos in range(len(e))] for e, tied in zip(errs, ties)])
        routed = dict(spread_summary(flat_err[keep], flat_kl[keep]), router_tie=tie,
                      near_tie_positions=int((~keep).sum()))
    threads = [t for t in spread_threads("cpu") if t is not None] if variants else None
    return Reference(errs, kls, spread_summary(flat_err, flat_kl), routed, threads, clock.lap())


def reference_provenance(ref: Reference, command: str) -> Dict[str, Any]:
    here = provenance("cpu")
    if ref.unmeasured:
        return {"hf_reference_unmeasured": ref.unmeasured, "hf_reference_measured": here["date"],
                "hf_reference_command": command}
    prov = {"hf_reference": ref.stats, "hf_reference_definition": REFERENCE_DEFINITION,
            "hf_reference_measured": here["date"], "hf_reference_device": here["device_name"],
            "hf_reference_torch": torch.__version__, "hf_reference_seconds": round(ref.seconds, 1),
            "hf_reference_command": command}
    if ref.threads:
        prov["hf_reference_threads"] = ref.threads
    if ref.routed is not None:
        prov.update(hf_reference_routed=ref.routed, hf_reference_routed_definition=ROUTED_DEFINITION)
    return prov


def attach(gs: GoldenSet, ref: Reference, command: str) -> GoldenSet:
    """The golden with the reference's per-position arrays and its provenance; everything else as it was."""
    for pg, err, kl in zip(gs.prompts, ref.errs, ref.kls):
        pg.reference_err, pg.reference_kl = err, kl
    for key in [k for k in gs.provenance if k.startswith("hf_reference")]:
        del gs.provenance[key]  # a measurement replaces the one before it whole
    gs.provenance.update(reference_provenance(ref, command))
    return gs


def add_reference(model: ModelRef, device_type: str, dtype: str, root: Path | None = None) -> Reference:
    """Measure HF's distance to float64 on a committed golden and write it into the golden (its arrays and
    provenance otherwise unchanged)."""
    from harness.golden_files import GoldenError, load, reference_command

    folder = golden_dir(model, device_type, dtype, root)
    if device_type == "cpu":
        gs = load_checked(model, device_type, dtype, root)
    else:  # another machine's golden: its tokenizer files may differ byte for byte; the reference needs its weights
        gs = load(folder)
        if gs.provenance.get("weights_sha256") != model.weights_sha256():
            raise GoldenError(f"golden {folder} was made from other weights than {model.folder}'s; the float64 "
                              f"reference must run on the golden's own weights")
    ref = measure(model, gs, variants=device_type == "cpu")
    save(attach(gs, ref, reference_command(model, device_type, dtype, root)), folder)
    return ref
