"""Golden files: HF's reference run on a prompt set, stored with provenance.

The files' format, their shape checks and the identity a golden must match live in harness.golden_files (imported
here, so that harness.golden is the one import for golden files). Decode row j is the distribution that predicted
continuation token j (row 0 is the prefill's last position).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, progress
from harness import golden_reference
from harness import prompts as P
from harness.compare import ROUTER_TIE, compare_row
from harness.hf_runs import at_threads, hf_model, router_margins, spread_summary, spread_threads  # hf_model re-exported
# with the names only callers use (ARRAYS, IDENTITY_KEYS, GoldenError, check_identity, load, regenerate_command)
from harness.golden_files import (ARRAYS, IDENTITY_KEYS, GoldenError, GoldenSet, PromptGolden, check_identity,
                                  expected_identity, golden_dir, load, load_checked, reference_command,
                                  regenerate_command, save)
from harness.models import GOLDEN_DIR, ModelRef, add_model_arguments, as_model, resolve_models
from harness.report import provenance

TOP_K = 64
NEW_TOKENS = P.NEW_TOKENS
# the models golden and parity run when none is named: the set the project ships goldens for
GOLDEN_MODELS = ("smollm2-135m", "tiny-qwen3", "tiny-qwen3-untied", "tiny-gemma3", "gemma3-270m", "tiny-qwen3-moe")


# ------------------------------------------------------------------------------------------------ HF reference
def _topk(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(k, dim=-1)
    return top.indices.int().cpu().numpy(), top.values.cpu().numpy()


SPREAD_DEFINITION = ("per position of prompt + continuation, HF against itself: sdpa at the golden's thread count "
                     "against eager attention and, on the CPU, sdpa and eager at 1, 2 and all cores' threads (each "
                     "variant on sdpa's top-K ids, the measure parity applies to the engine; a position's value is "
                     "its largest over the variants): max |logprob difference| ('err') and KL(sdpa || variant) with "
                     "a rest bucket ('kl'); their distribution over every position of every prompt")
ROUTED_DEFINITION = ("mixture-of-experts models: the same distribution over the positions where none of its runs "
                     "has a router near tie (a margin <= router_tie in any MoE layer, engine.moe.router_margin, "
                     "teacher-forced on the golden's sequences); hf_router_near_ties lists sdpa's (the golden's) near "
                     "ties per prompt, by position")


@dataclass
class Spread:
    """HF against itself. stats: over every position; for MoE models routed: over the positions where neither run
    has a router near tie, and near_ties: sdpa's near-tie positions per sequence."""
    stats: Dict[str, Any]
    routed: Dict[str, Any] | None = None
    near_ties: List[List[int]] | None = None
    threads: List[int] | None = None  # the CPU thread counts covered


def hf_spread(sdpa: Any, eager: Any, sequences: List[List[int]], device: str, router_tie: float | None = None) -> Spread:
    """HF against itself: every sequence through sdpa at this process's thread count (the golden's run) and through
    each variant (eager attention, and sdpa and eager at every count of spread_threads), compared position by
    position on sdpa's top-K ids with the engine's own measure (harness.compare.compare_row); a position's err and KL
    are its largest over the variants. router_tie (MoE models): the near-tie margin of the dtype, for the routed
    statistics (a near tie in any run counts)."""
    errs, kls, tied, near_ties = [], [], [], []
    kw = {} if router_tie is None else {"output_router_logits": True}
    variants = [(m, t) for t in spread_threads(device) for m in (sdpa, eager)
                if not (m is sdpa and t in (None, torch.get_num_threads()))]
    for seq in sequences:
        full = torch.tensor([seq], device=device)
        oa = sdpa(full, **kw)
        a = torch.log_softmax(oa.logits[0].float(), -1).cpu()
        ids = a.topk(TOP_K, -1).indices
        seq_err, seq_kl = np.zeros(len(seq)), np.zeros(len(seq))
        ta = None if router_tie is None else router_margins(oa, len(seq), sdpa.config.num_experts_per_tok) <= router_tie
        tb = np.zeros(len(seq), dtype=bool)
        for model, threads in variants:
            ob = at_threads(model, threads, full, kw)
            b = torch.log_softmax(ob.logits[0].float(), -1).cpu()
            for pos in range(len(seq)):
                st = compare_row(b[pos], ids[pos].numpy(), a[pos, ids[pos]].numpy())
                seq_err[pos], seq_kl[pos] = max(seq_err[pos], st.err), max(seq_kl[pos], st.kl)
            if router_tie is not None:
                tb |= router_margins(ob, len(seq), sdpa.config.num_experts_per_tok) <= router_tie
        errs += list(seq_err)
        kls += list(seq_kl)
        if router_tie is not None:
            tied += list(ta | tb)
            near_ties.append([int(p) for p in np.nonzero(ta)[0]])
    threads = [t for t in spread_threads(device) if t is not None] or None
    if router_tie is None:
        return Spread(spread_summary(errs, kls), threads=threads)
    keep = ~np.asarray(tied)
    routed = dict(spread_summary(np.asarray(errs)[keep], np.asarray(kls)[keep]), router_tie=router_tie,
                  near_tie_positions=int((~keep).sum()))
    return Spread(spread_summary(errs, kls), routed, near_ties, threads)


def _sequences(prompts: List[PromptGolden]) -> List[List[int]]:
    """Each prompt followed by its greedy continuation: what HF's spread is measured on."""
    return [list(map(int, p.prompt_ids)) + list(map(int, p.tokens)) for p in prompts]


def _spread_provenance(spread: Spread, names: List[str]) -> Dict[str, Any]:
    prov = {"hf_spread_max_abs_logprob": spread.stats["err_max"], "hf_spread": spread.stats,
            "hf_spread_definition": SPREAD_DEFINITION}
    if spread.threads:
        prov["hf_spread_threads"] = spread.threads
    if spread.routed is not None:
        prov.update(hf_spread_routed=spread.routed, hf_router_near_ties=dict(zip(names, spread.near_ties)),
                    hf_spread_routed_definition=ROUTED_DEFINITION)
    return prov


def _router_tie(hf: Any, dtype: torch.dtype) -> float | None:
    """The near-tie margin of a mixture-of-experts model in this dtype, None for a dense one."""
    return ROUTER_TIE[str(dtype).removeprefix("torch.")] if hasattr(hf.config, "num_experts_per_tok") else None


@torch.inference_mode()
def make_golden(model: ModelRef | str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                prompts: P.PromptSet | None = None) -> GoldenSet:
    """Run HF (sdpa attention) greedily on every prompt of the set (default: the default set); measure HF's own
    spread with eager attention."""
    from transformers import AutoTokenizer

    ref = as_model(model)
    pset = prompts or P.default_set(ref)
    tok = AutoTokenizer.from_pretrained(ref.folder)
    ids = P.tokenize(tok, pset.prompts)
    _check_lengths(ref, pset, ids)
    hf, hf_eager = hf_model(ref, device, dtype), hf_model(ref, device, dtype, attn="eager")
    # eos_token_id=[]: run every step asked for; EOS handling is the driver's, tested apart
    gen = dict(do_sample=False, eos_token_id=[], pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    out: List[PromptGolden] = []
    for p, pid in progress.bar(list(zip(pset.prompts, ids)), desc=f"golden {ref.name} {device} {dtype}"):
        x = torch.tensor([pid], device=device)
        res = hf.generate(x, max_new_tokens=P.new_tokens(p), **gen)
        tokens = res.sequences[0, len(pid):]
        if len(tokens) != P.new_tokens(p):
            raise RuntimeError(f"HF stopped after {len(tokens)} tokens on {p['name']!r}")
        prefill_ids, prefill_lp = _topk(hf(x).logits[0], TOP_K)
        decode_ids, decode_lp = _topk(torch.stack(res.logits)[:, 0], TOP_K)
        out.append(PromptGolden(p["name"], np.array(pid, dtype=np.int32), tokens.int().cpu().numpy(),
                                prefill_ids, prefill_lp, decode_ids, decode_lp))
    spread = hf_spread(hf, hf_eager, _sequences(out), device, _router_tie(hf, dtype))
    dtype_name = str(dtype).removeprefix("torch.")
    experts = getattr(hf.config, "_experts_implementation", None) if hasattr(hf.config, "num_experts_per_tok") else None
    del hf, hf_eager  # before the float64 reference loads its own copies
    prov = provenance(device, **expected_identity(ref, device.split(":")[0], dtype_name, pset),
                      top_k=TOP_K, new_tokens=NEW_TOKENS, attention="sdpa", prompt_source=pset.source,
                      prompt_set=pset.prompts, **_spread_provenance(spread, [p.name for p in out]),
                      **({"experts_implementation": experts} if experts else {}))
    gs = GoldenSet(out, prov)
    kind = device.split(":")[0]
    reference = golden_reference.measure(ref, gs, variants=kind == "cpu")
    return golden_reference.attach(gs, reference, reference_command(ref, kind, dtype_name))


def _check_lengths(ref: ModelRef, pset: P.PromptSet, ids: List[List[int]]) -> None:
    """Refuse a prompt HF cannot run: no tokens, or longer with its continuation than the model's positions."""
    limit = ref.config.rotary_config.max_position
    for p, pid in zip(pset.prompts, ids):
        if not pid:
            raise UserError(f"prompt {p['name']!r} tokenizes to no tokens; give it some text")
        if len(pid) + P.new_tokens(p) > limit:
            raise UserError(f"prompt {p['name']!r} has {len(pid)} tokens and asks for {P.new_tokens(p)} more, beyond "
                            f"the model's {limit} positions (max_position_embeddings); shorten it")
def _envelope(recorded: Dict[str, Any] | None, measured: Dict[str, Any] | None) -> Dict[str, Any] | None:
    """Each statistic at the larger of its recorded and its measured value: a spread measured on another machine
    adds HF's variation there (its BLAS, its kernels), it does not replace the variation measured before."""
    if not recorded or measured is None:
        return measured
    return {k: max(v, recorded[k]) if isinstance(v, float) and isinstance(recorded.get(k), float) else v
            for k, v in measured.items()}


@torch.inference_mode()
def refresh_spread(model: ModelRef | str, device: str, dtype: torch.dtype, root: Path | None = None) -> Spread:
    """Measure HF's spread again on the committed golden's own sequences and rewrite only its provenance.json
    (the golden's arrays stay as they are). The spread recorded so far is kept where it is larger (_envelope), so
    that a correct engine passes on every machine measured; hf_spread_devices lists them."""
    dtype_name = str(dtype).removeprefix("torch.")
    gs = load_checked(model, device.split(":")[0], dtype_name, root)
    hf, hf_eager = hf_model(model, device, dtype), hf_model(model, device, dtype, attn="eager")
    spread = hf_spread(hf, hf_eager, _sequences(gs.prompts), device, _router_tie(hf, dtype))
    old = gs.provenance
    recorded = dict(old.get("hf_spread") or {})
    if "hf_spread_max_abs_logprob" in old:  # older goldens record only the largest err
        recorded["err_max"] = max(recorded.get("err_max", 0.0), float(old["hf_spread_max_abs_logprob"]))
    spread = Spread(_envelope(recorded, spread.stats), _envelope(old.get("hf_spread_routed"), spread.routed),
                    spread.near_ties, spread.threads)
    folder = golden_dir(model, device.split(":")[0], dtype_name, root)
    names = [p.name for p in gs.prompts]
    here = provenance(device)
    devices = sorted(set(old.get("hf_spread_devices", [old.get("device_name", "")])) | {here["device_name"]})
    prov = dict(old, **_spread_provenance(spread, names), hf_spread_measured=here["date"],
                hf_spread_devices=[d for d in devices if d])
    prov["prompt_names"] = names
    (folder / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    return spread


# ------------------------------------------------------------------------------------------------ CLI
def drift(committed: GoldenSet, fresh: GoldenSet) -> Dict[str, Any]:
    """How far HF today is from the committed golden: token mismatches and log-prob error on the golden's ids."""
    tok_mismatch, err = 0, 0.0
    for a, b in zip(committed.prompts, fresh.prompts):
        tok_mismatch += int((a.tokens != b.tokens).sum())
        for ids, lp, ref_ids, ref_lp in ((b.prefill_ids, b.prefill_lp, a.prefill_ids, a.prefill_lp),
                                         (b.decode_ids, b.decode_lp, a.decode_ids, a.decode_lp)):
            same = ids[:, :1] == ref_ids[:, :1]
            err = max(err, float(np.abs(np.where(same, lp[:, :1] - ref_lp[:, :1], 0)).max()))
    return {"token_mismatches": tok_mismatch, "max_abs_top1_logprob_diff": err}


def _cmd(args: argparse.Namespace) -> int:
    if not args.add_reference:  # the float64 reference runs on the CPU, for a GPU's golden too
        check_device(args.device)
    kind, dtype = args.device.split(":")[0], getattr(torch, args.dtype)
    refs = resolve_models(args, GOLDEN_MODELS, verb="golden")
    given = P.read_file(args.prompts) if args.prompts else None
    for flag, on in (("--refresh-spread", args.refresh_spread), ("--add-reference", args.add_reference)):
        if given is not None and on:
            raise UserError(f"{flag} measures on the golden's own sequences; leave --prompts out")
    # the goldens --check and --refresh-spread start from, refused (missing, stale) before HF runs
    committed = {r.name: load_checked(r, kind, args.dtype, prompts=given) if kind == "cpu" or not args.add_reference
                 else load(golden_dir(r, kind, args.dtype)) for r in refs
                 if args.check or args.refresh_spread or args.add_reference}
    status = EXIT_PASS
    for ref in refs:
        folder, clock = golden_dir(ref, kind, args.dtype), progress.Stopwatch()
        what = f"{ref.name} {args.device} {args.dtype}"
        if args.refresh_spread:
            spread = refresh_spread(ref, args.device, dtype, root=ref.golden_root)
            progress.line("golden", f"{what} spread", "done", clock.lap())
            for label, st in (("", spread.stats), (" (no router near tie)", spread.routed)):
                if st is not None:
                    print(f"{ref.name}: HF spread over {st['positions']} positions{label}: err p99 "
                          f"{st['err_p99']:.3g}, max {st['err_max']:.3g}; KL mean {st['kl_mean']:.3g}, p99 "
                          f"{st['kl_p99']:.3g}")
            print(f"  written to {folder / 'provenance.json'}")
            continue
        if args.add_reference:
            reference = golden_reference.add_reference(ref, kind, args.dtype, root=ref.golden_root)
            progress.line("golden", f"{what} float64 reference", "done", clock.lap())
            print(f"{ref.name}: HF to float64 not measured: {reference.unmeasured}" if reference.unmeasured else
                  _reference_line(ref.name, reference.stats, committed[ref.name].provenance))
            print(f"  written to {folder} (golden.npz: reference_err, reference_kl; provenance.json: hf_reference)")
            continue
        pset = given or (P.expected_set(committed[ref.name].provenance, ref) if args.check else None)
        fresh = make_golden(ref, args.device, dtype, pset)
        if args.check:
            d = drift(committed[ref.name], fresh)
            ok = d["token_mismatches"] == 0 and d["max_abs_top1_logprob_diff"] <= \
                4 * committed[ref.name].provenance["hf_spread_max_abs_logprob"]
            progress.line("golden", f"{what} check", "PASS" if ok else "DRIFT", clock.lap())
            print(f"{ref.name}: HF {'agrees with' if ok else 'DRIFTED from'} {folder}: {d}")
            status = status if ok else EXIT_FINDING
        else:
            save(fresh, folder)
            progress.line("golden", what, "wrote", clock.lap())
            far = fresh.provenance.get("hf_reference")
            print(f"wrote {folder} (HF spread {fresh.provenance['hf_spread_max_abs_logprob']:.2e}, HF to float64 " +
                  (f"{far['err_max']:.2e})" if far else f"not measured: {fresh.provenance['hf_reference_unmeasured']})"))
    return status


def _reference_line(name: str, stats: Dict[str, Any], prov: Dict[str, Any]) -> str:
    spread = prov.get("hf_spread") or {"err_max": prov["hf_spread_max_abs_logprob"]}
    return (f"{name}: HF to float64 over {stats['positions']} positions: err p99 {stats['err_p99']:.3g}, max "
            f"{stats['err_max']:.3g}; KL mean {stats['kl_mean']:.3g} (HF's kernel spread: err max "
            f"{spread['err_max']:.3g})")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("golden", help="run HF on the prompt set and write (or --check) golden files")
    add_model_arguments(p, ", ".join(GOLDEN_MODELS), golden=True)
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="the prompts: a JSON list of strings, or JSON lines of {\"prompt\": ..., \"max_new_tokens\": "
                        "...}; the golden records them (default: golden/prompts.json, and golden/prompts-long.json "
                        "for a model with a sliding window)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true",
                      help="regenerate in memory and report drift from the committed files")
    what.add_argument("--refresh-spread", action="store_true",
                      help="measure HF's sdpa-vs-eager spread again on the committed golden's sequences and rewrite "
                           "only its provenance (the arrays stay)")
    what.add_argument("--add-reference", action="store_true",
                      help="measure HF's distance to float64 arithmetic (HF float64 on the CPU) at every position of "
                           "an existing golden and add it, the golden's arrays and provenance otherwise kept: what "
                           "parity's tolerance needs of a golden made before it")
    p.set_defaults(func=_cmd)
