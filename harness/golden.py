"""Golden files: HF's reference run on a prompt set, stored with provenance.

The files' format, their shape checks and the identity a golden must match live in harness.golden_files (imported
here, so that harness.golden is the one import for golden files). Decode row j is the distribution that predicted
continuation token j (row 0 is the prefill's last position).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, progress
from harness import golden_reference, hf_referee
from harness import prompts as P
from harness.hf_runs import hf_model, router_margins, spread_summary  # re-exported
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


@torch.inference_mode()
def make_golden(model: ModelRef | str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                prompts: P.PromptSet | None = None) -> GoldenSet:
    """Run HF (sdpa attention) greedily on every prompt of the set (default: the default set); measure HF's settings
    and its rows against float64 at every position (harness.golden_reference) and judge them (harness.hf_referee)."""
    from transformers import AutoTokenizer

    ref = as_model(model)
    pset = prompts or P.default_set(ref)
    tok = AutoTokenizer.from_pretrained(ref.folder)
    ids = P.tokenize(tok, pset.prompts)
    _check_lengths(ref, pset, ids)
    hf = hf_model(ref, device, dtype)
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
    dtype_name = str(dtype).removeprefix("torch.")
    experts = getattr(hf.config, "_experts_implementation", None) if hasattr(hf.config, "num_experts_per_tok") else None
    del hf  # before HF's runs are measured, each model loaded in its turn
    prov = provenance(device, **expected_identity(ref, device.split(":")[0], dtype_name, pset),
                      top_k=TOP_K, new_tokens=NEW_TOKENS, attention="sdpa", prompt_source=pset.source,
                      prompt_set=pset.prompts, **({"experts_implementation": experts} if experts else {}))
    gs = GoldenSet(out, prov)
    runs = golden_reference.measure(ref, gs, device)
    golden_reference.attach(gs, runs, reference_command(ref, device.split(":")[0], dtype_name))
    return gs


def _check_lengths(ref: ModelRef, pset: P.PromptSet, ids: List[List[int]]) -> None:
    """Refuse a prompt HF cannot run: no tokens, or longer with its continuation than the model's positions."""
    limit = ref.config.rotary_config.max_position
    for p, pid in zip(pset.prompts, ids):
        if not pid:
            raise UserError(f"prompt {p['name']!r} tokenizes to no tokens; give it some text")
        if len(pid) + P.new_tokens(p) > limit:
            raise UserError(f"prompt {p['name']!r} has {len(pid)} tokens and asks for {P.new_tokens(p)} more, beyond "
                            f"the model's {limit} positions (max_position_embeddings); shorten it")


def refresh_spread(model: ModelRef | str, device: str, dtype: torch.dtype, root: Path | None = None
                   ) -> hf_referee.Verdict:
    """Measure HF's settings on this device and HF's rows against float64 again on the committed golden's own
    sequences, and rewrite their records (its rows and tokens stay). A setting recorded before keeps, position by
    position, the larger of its recorded and its measured values (golden_reference.attach): a spread measured on
    another machine adds HF's variation there, so that a correct engine passes on every machine measured
    (hf_spread_devices lists them)."""
    dtype_name, kind = str(dtype).removeprefix("torch."), device.split(":")[0]
    ref = as_model(model, root)
    return golden_reference.remeasure(ref, kind, dtype_name, device, reference_command(ref, kind, dtype_name, root),
                                      root)


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
        if args.refresh_spread:  # float64 on this host, HF's settings on this device
            refresh_spread(ref, args.device, dtype, root=ref.golden_root)
        elif args.add_reference:  # float64 on this host, HF's settings too where the golden's device is the CPU
            golden_reference.remeasure(ref, kind, args.dtype, "cpu" if kind == "cpu" else None,
                                       reference_command(ref, kind, args.dtype), ref.golden_root)
        if args.refresh_spread or args.add_reference:
            progress.line("golden", f"{what} {'HF runs' if args.refresh_spread else 'float64 reference'}", "done",
                          clock.lap())
            print("\n".join(_hf_lines(ref.name, load(folder).provenance)))
            print(f"  written to {folder} (golden.npz: HF's runs per position; provenance.json: their verdict)")
            continue
        pset = given or (P.expected_set(committed[ref.name].provenance, ref) if args.check else None)
        fresh = make_golden(ref, args.device, dtype, pset)
        if args.check:
            from harness.parity.gate import tolerance

            d = drift(committed[ref.name], fresh)  # HF today against the golden, within what parity allows an engine
            ok = d["token_mismatches"] == 0 and d["max_abs_top1_logprob_diff"] <= \
                tolerance(committed[ref.name], args.dtype, ref.is_moe)
            progress.line("golden", f"{what} check", "PASS" if ok else "DRIFT", clock.lap())
            print(f"{ref.name}: HF {'agrees with' if ok else 'DRIFTED from'} {folder}: {d}")
            for label, gs in (("committed", committed[ref.name]), ("HF now", fresh)):
                for line in hf_referee.findings(gs.provenance):  # HF's own bugs, in the golden and in HF today
                    print(f"  {label}: {line}")
            status = status if ok else EXIT_FINDING
        else:
            save(fresh, folder)
            progress.line("golden", what, "wrote", clock.lap())
            print(f"wrote {folder}\n" + "\n".join(_hf_lines(ref.name, fresh.provenance)))
    return status


def _hf_lines(name: str, prov: Dict[str, Any]) -> List[str]:
    """HF's spread and distance to float64 as the golden records them, and what float64 refutes."""
    spread = prov.get("hf_spread") or {"err_max": prov["hf_spread_max_abs_logprob"]}
    far = prov.get("hf_reference")
    lines = [f"{name}: HF's spread (agreeing with float64) over {spread.get('positions', '?')} positions: err max "
             f"{spread['err_max']:.3g}; HF to float64 " +
             (f"over {far['positions']} positions: err p99 {far['err_p99']:.3g}, max {far['err_max']:.3g}"
              if far else f"not measured: {prov.get('hf_reference_unmeasured')}")]
    return lines + [f"  {line}" for line in hf_referee.findings(prov)]


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
                      help="measure HF's settings on this device (sdpa and eager attention, thread counts) and its "
                           "rows against float64 again on the committed golden's sequences, and rewrite those records "
                           "(the rows and tokens stay; a setting measured before keeps the larger values)")
    what.add_argument("--add-reference", action="store_true",
                      help="measure HF's distance to float64 arithmetic (HF float64 on the CPU) at every position of "
                           "an existing golden (and, for a CPU golden, HF's settings here), its rows and tokens kept: "
                           "what parity's tolerance needs of a golden made before it")
    p.set_defaults(func=_cmd)
