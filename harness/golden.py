"""Golden files: HF's reference run on the fixed prompt set, stored with provenance.

golden/<model>/<device>-<dtype>/golden.npz     per prompt: prompt ids, the greedy continuation, and at every prefill
                                               and decode position the top-K log-probabilities with their token ids
golden/<model>/<device>-<dtype>/provenance.json versions, device, dtype, weights / tokenizer / prompt-set hashes,
                                               HF's own spread (sdpa vs eager attention), the command

Decode row j is the distribution that predicted continuation token j (row 0 is the prefill's last position).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
from tqdm import tqdm

from engine.moe.base import router_margin
from engine.utils.device import physical_cores
from harness import UserError, check_device, zoo
from harness.compare import ROUTER_TIE, compare_row
from harness.report import provenance

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
PROMPTS_FILE = GOLDEN_DIR / "prompts.json"
LONG_PROMPTS_FILE = GOLDEN_DIR / "prompts-long.json"  # longer than gemma3-270m's 512-token window
LONG_PROMPT_MODELS = ("gemma3-270m", "tiny-gemma3")
NO_CHAT_TEMPLATE = ("gemma3-270m",)  # its GGUF carries no chat template: the chat prompt is left out
TOP_K = 64
NEW_TOKENS = 32
GOLDEN_MODELS = ("smollm2-135m", "tiny-qwen3", "tiny-qwen3-untied", "tiny-gemma3", "gemma3-270m", "tiny-qwen3-moe")
# A golden made under other values of these is not comparable: refuse, and say how to regenerate.
IDENTITY_KEYS = ("model", "dtype", "device_type", "weights_sha256", "tokenizer_sha256", "prompt_set_sha256")


class GoldenError(UserError):
    """A golden file that is missing, corrupt, or made for something else."""


@dataclass
class PromptGolden:
    name: str
    prompt_ids: np.ndarray  # [P] int32
    tokens: np.ndarray  # [T] int32, HF's greedy continuation
    prefill_ids: np.ndarray  # [P, K] int32, top-K token ids at each prompt position
    prefill_lp: np.ndarray  # [P, K] float32, their log-probabilities
    decode_ids: np.ndarray  # [T, K] int32
    decode_lp: np.ndarray  # [T, K] float32


@dataclass
class GoldenSet:
    prompts: List[PromptGolden]
    provenance: Dict[str, Any]


def golden_dir(model: str, device_type: str, dtype: str, root: Path = GOLDEN_DIR) -> Path:
    return root / model / f"{device_type}-{dtype}"


def regenerate_command(model: str, device_type: str, dtype: str) -> str:
    return f"python -m harness golden --model {model} --device {device_type} --dtype {dtype}"


def prompt_files(model: str | None = None) -> List[Path]:
    """The prompt set of a model: the shared prompts, plus prompts longer than the window for sliding-window ones."""
    return [PROMPTS_FILE] + ([LONG_PROMPTS_FILE] if model in LONG_PROMPT_MODELS else [])


def load_prompts(model: str | None = None) -> List[Dict[str, Any]]:
    prompts = [p for f in prompt_files(model) for p in json.loads(f.read_text())["prompts"]]
    return [p for p in prompts if "chat" not in p] if model in NO_CHAT_TEMPLATE else prompts


def prompt_set_sha256(model: str | None = None) -> str:
    """The shared set's file hash; a model's own selection hashes the prompts it uses."""
    if prompt_files(model) == [PROMPTS_FILE] and model not in NO_CHAT_TEMPLATE:
        return hashlib.sha256(PROMPTS_FILE.read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(load_prompts(model), sort_keys=True).encode()).hexdigest()


def tokenize_prompts(tokenizer: Any, prompts: List[Dict[str, Any]]) -> List[List[int]]:
    out = []
    for p in prompts:
        if "chat" in p:
            ids = tokenizer.apply_chat_template(p["chat"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(p["text"]).input_ids
        out.append([int(i) for i in ids])
    return out


def expected_identity(model: str, device_type: str, dtype: str) -> Dict[str, str]:
    folder = zoo.path(model)
    return {"model": model, "dtype": dtype, "device_type": device_type,
            "weights_sha256": zoo.info(model)["weights_sha256"], "tokenizer_sha256": zoo.tokenizer_sha256(folder),
            "prompt_set_sha256": prompt_set_sha256(model)}


# ------------------------------------------------------------------------------------------------ HF reference
def _topk(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(k, dim=-1)
    return top.indices.int().cpu().numpy(), top.values.cpu().numpy()


def hf_model(model: str, device: str, dtype: torch.dtype, attn: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(zoo.path(model), dtype=dtype, attn_implementation=attn).to(device).eval()


SPREAD_DEFINITION = ("per position of prompt + continuation, HF against itself: sdpa at the golden's thread count "
                     "against eager attention and, on the CPU, sdpa and eager at 1, 2 and all cores' threads (each "
                     "variant on sdpa's top-K ids, the measure parity applies to the engine; a position's value is "
                     "its largest over the variants): max |logprob difference| ('err') and KL(sdpa || variant) with "
                     "a rest bucket ('kl'); their distribution over every position of every prompt")
ROUTED_DEFINITION = ("mixture-of-experts models: the same distribution over the positions where none of its runs "
                     "has a router near tie (a margin <= router_tie in any MoE layer, engine.moe.router_margin, "
                     "teacher-forced on the golden's sequences); hf_router_near_ties lists sdpa's (the golden's) near "
                     "ties per prompt, by position")


def spread_summary(errs: Sequence[float], kls: Sequence[float]) -> Dict[str, Any]:
    """Distribution of per-position errors and KLs: the statistics parity's half-precision gate compares."""
    e, k = np.asarray(errs, dtype=np.float64), np.asarray(kls, dtype=np.float64)
    return {"positions": int(e.size), **{f"{name}_{q}": float(np.quantile(x, v)) for name, x in (("err", e), ("kl", k))
                                         for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "err_max": float(e.max()), "err_mean": float(e.mean()), "kl_max": float(k.max()),
            "kl_mean": float(k.mean())}


def router_margins(out: Any, n: int, top_k: int) -> np.ndarray:
    """[n]: each position's smallest router margin over the MoE layers of an HF forward run with
    output_router_logits."""
    return torch.stack([router_margin(r.reshape(n, -1), top_k) for r in out.router_logits]).amin(0).cpu().numpy()


@dataclass
class Spread:
    """HF against itself. stats: over every position; for MoE models routed: over the positions where neither run
    has a router near tie, and near_ties: sdpa's near-tie positions per sequence."""
    stats: Dict[str, Any]
    routed: Dict[str, Any] | None = None
    near_ties: List[List[int]] | None = None
    threads: List[int] | None = None  # the CPU thread counts covered


def spread_threads(device: str) -> List[int | None]:
    """The thread counts HF's spread covers: on the CPU 1, 2 and all cores (a user's run may use any of them, and a
    product's bits follow its split across threads); None on a GPU (the current setting)."""
    return [None] if device.split(":")[0] != "cpu" else sorted({1, min(2, physical_cores()), physical_cores()})


def _at_threads(model: Any, threads: int | None, full: torch.Tensor, kw: Dict[str, Any]) -> Any:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return model(full, **kw)
    finally:
        torch.set_num_threads(before)


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
            ob = _at_threads(model, threads, full, kw)
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
def make_golden(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> GoldenSet:
    """Run HF (sdpa attention) greedily on every prompt; measure HF's own spread with eager attention."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(zoo.path(model))
    prompts = load_prompts(model)
    ids = tokenize_prompts(tok, prompts)
    hf, hf_eager = hf_model(model, device, dtype), hf_model(model, device, dtype, attn="eager")
    # eos_token_id=[]: run all NEW_TOKENS steps; EOS handling is the driver's, tested apart
    gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[], pad_token_id=0, output_logits=True,
               return_dict_in_generate=True)
    out: List[PromptGolden] = []
    for p, pid in tqdm(list(zip(prompts, ids)), desc=f"golden {model} {device} {dtype}"):
        x = torch.tensor([pid], device=device)
        res = hf.generate(x, **gen)
        tokens = res.sequences[0, len(pid):]
        if len(tokens) != NEW_TOKENS:
            raise RuntimeError(f"HF stopped after {len(tokens)} tokens on {p['name']!r}")
        prefill_ids, prefill_lp = _topk(hf(x).logits[0], TOP_K)
        decode_ids, decode_lp = _topk(torch.stack(res.logits)[:, 0], TOP_K)
        out.append(PromptGolden(p["name"], np.array(pid, dtype=np.int32), tokens.int().cpu().numpy(),
                                prefill_ids, prefill_lp, decode_ids, decode_lp))
    spread = hf_spread(hf, hf_eager, _sequences(out), device, _router_tie(hf, dtype))
    dtype_name = str(dtype).removeprefix("torch.")
    experts = getattr(hf.config, "_experts_implementation", None) if hasattr(hf.config, "num_experts_per_tok") else None
    prov = provenance(device, **expected_identity(model, device.split(":")[0], dtype_name),
                      top_k=TOP_K, new_tokens=NEW_TOKENS, attention="sdpa",
                      **_spread_provenance(spread, [p.name for p in out]),
                      **({"experts_implementation": experts} if experts else {}))
    return GoldenSet(out, prov)


def _envelope(recorded: Dict[str, Any] | None, measured: Dict[str, Any] | None) -> Dict[str, Any] | None:
    """Each statistic at the larger of its recorded and its measured value: a spread measured on another machine
    adds HF's variation there (its BLAS, its kernels), it does not replace the variation measured before."""
    if not recorded or measured is None:
        return measured
    return {k: max(v, recorded[k]) if isinstance(v, float) and isinstance(recorded.get(k), float) else v
            for k, v in measured.items()}


@torch.inference_mode()
def refresh_spread(model: str, device: str, dtype: torch.dtype, root: Path = GOLDEN_DIR) -> Spread:
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


# ------------------------------------------------------------------------------------------------ file I/O
def save(gs: GoldenSet, folder: Path, stem: str = "golden") -> None:
    """stem "golden.obtained" writes an engine's result beside the golden, in the same format."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays: Dict[str, np.ndarray] = {}
    for i, p in enumerate(gs.prompts):
        for field in ("prompt_ids", "tokens", "prefill_ids", "prefill_lp", "decode_ids", "decode_lp"):
            arrays[f"{i}/{field}"] = getattr(p, field)
    np.savez_compressed(folder / f"{stem}.npz", **arrays)
    prov = dict(gs.provenance, prompt_names=[p.name for p in gs.prompts])
    (folder / f"{stem.replace('golden', 'provenance')}.json").write_text(json.dumps(prov, indent=2) + "\n")


def load(folder: Path) -> GoldenSet:
    npz, prov_file = folder / "golden.npz", folder / "provenance.json"
    for f in (npz, prov_file):
        if not f.is_file():
            raise GoldenError(f"missing golden file {f}")
    try:
        prov = json.loads(prov_file.read_text())
        names = prov["prompt_names"]
        with np.load(npz) as data:
            prompts = [PromptGolden(name, *(data[f"{i}/{k}"] for k in ("prompt_ids", "tokens", "prefill_ids",
                                                                        "prefill_lp", "decode_ids", "decode_lp")))
                       for i, name in enumerate(names)]
    except (ValueError, KeyError, OSError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise GoldenError(f"corrupt golden file in {folder}: {type(e).__name__}: {e}") from e
    for p in prompts:
        t, k = len(p.tokens), prov.get("top_k", TOP_K)
        if p.prefill_ids.shape != (len(p.prompt_ids), k) or p.decode_ids.shape != (t, k) or \
                p.prefill_lp.shape != p.prefill_ids.shape or p.decode_lp.shape != p.decode_ids.shape:
            raise GoldenError(f"corrupt golden file {npz}: arrays of prompt {p.name!r} have inconsistent shapes")
    return GoldenSet(prompts, prov)


def check_identity(gs: GoldenSet, expected: Dict[str, str], folder: Path) -> None:
    """Refuse a golden made for another model, weights, tokenizer, prompt set, dtype or device."""
    bad = [f"{k}: golden has {gs.provenance.get(k)!r}, here {v!r}" for k, v in expected.items()
           if gs.provenance.get(k) != v]
    if bad:
        cmd = regenerate_command(expected["model"], expected["device_type"], expected["dtype"])
        raise GoldenError(f"golden {folder} was made for something else:\n  " + "\n  ".join(bad) +
                          f"\nIf the change is intended, regenerate it: {cmd}")


def load_checked(model: str, device_type: str, dtype: str, root: Path = GOLDEN_DIR) -> GoldenSet:
    folder = golden_dir(model, device_type, dtype, root)
    if not folder.exists():
        raise GoldenError(f"no golden for {model} on {device_type} in {dtype} ({folder} is missing); make it with: "
                          f"{regenerate_command(model, device_type, dtype)}")
    gs = load(folder)
    check_identity(gs, expected_identity(model, device_type, dtype), folder)
    return gs


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
    check_device(args.device)
    dtype = getattr(torch, args.dtype)
    models = args.model or list(GOLDEN_MODELS)
    # the committed goldens --check and --refresh-spread start from, refused (missing, stale) before HF runs
    committed = {m: load_checked(m, args.device, args.dtype) for m in models if args.check or args.refresh_spread}
    status = 0
    for model in models:
        folder = golden_dir(model, args.device, args.dtype)
        if args.refresh_spread:
            spread = refresh_spread(model, args.device, dtype)
            for label, st in (("", spread.stats), (" (no router near tie)", spread.routed)):
                if st is not None:
                    print(f"{model}: HF spread over {st['positions']} positions{label}: err p99 {st['err_p99']:.3g}, "
                          f"max {st['err_max']:.3g}; KL mean {st['kl_mean']:.3g}, p99 {st['kl_p99']:.3g}")
            print(f"  written to {folder / 'provenance.json'}")
            continue
        fresh = make_golden(model, args.device, dtype)
        if args.check:
            d = drift(committed[model], fresh)
            ok = d["token_mismatches"] == 0 and d["max_abs_top1_logprob_diff"] <= \
                4 * committed[model].provenance["hf_spread_max_abs_logprob"]
            print(f"{model}: HF {'agrees with' if ok else 'DRIFTED from'} {folder}: {d}")
            status |= 0 if ok else 1
        else:
            save(fresh, folder)
            print(f"wrote {folder} (HF spread {fresh.provenance['hf_spread_max_abs_logprob']:.2e})")
    return status


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("golden", help="run HF on the prompt set and write (or --check) golden files")
    p.add_argument("--model", action="append", choices=list(zoo.MODELS), help=f"default: {', '.join(GOLDEN_MODELS)}")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true",
                      help="regenerate in memory and report drift from the committed files")
    what.add_argument("--refresh-spread", action="store_true",
                      help="measure HF's sdpa-vs-eager spread again on the committed golden's sequences and rewrite "
                           "only its provenance (the arrays stay)")
    p.set_defaults(func=_cmd)
