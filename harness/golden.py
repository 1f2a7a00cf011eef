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
from typing import Any, Dict, List

import numpy as np
import torch
from tqdm import tqdm

from harness import zoo
from harness.report import provenance

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
PROMPTS_FILE = GOLDEN_DIR / "prompts.json"
TOP_K = 64
NEW_TOKENS = 32
GOLDEN_MODELS = ("smollm2-135m", "tiny-qwen3", "tiny-qwen3-untied")
# A golden made under other values of these is not comparable: refuse, and say how to regenerate.
IDENTITY_KEYS = ("model", "dtype", "device_type", "weights_sha256", "tokenizer_sha256", "prompt_set_sha256")


class GoldenError(Exception):
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


def load_prompts() -> List[Dict[str, Any]]:
    return json.loads(PROMPTS_FILE.read_text())["prompts"]


def prompt_set_sha256() -> str:
    return hashlib.sha256(PROMPTS_FILE.read_bytes()).hexdigest()


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
            "prompt_set_sha256": prompt_set_sha256()}


# ------------------------------------------------------------------------------------------------ HF reference
def _topk(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(k, dim=-1)
    return top.indices.int().cpu().numpy(), top.values.cpu().numpy()


def hf_model(model: str, device: str, dtype: torch.dtype, attn: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(zoo.path(model), dtype=dtype, attn_implementation=attn).to(device).eval()


@torch.inference_mode()
def make_golden(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> GoldenSet:
    """Run HF (sdpa attention) greedily on every prompt; measure HF's own spread with eager attention."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(zoo.path(model))
    prompts = load_prompts()
    ids = tokenize_prompts(tok, prompts)
    hf, hf_eager = hf_model(model, device, dtype), hf_model(model, device, dtype, attn="eager")
    # eos_token_id=[]: run all NEW_TOKENS steps; EOS handling is the driver's, tested apart
    gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[], pad_token_id=0, output_logits=True,
               return_dict_in_generate=True)
    out: List[PromptGolden] = []
    spread = 0.0
    for p, pid in tqdm(list(zip(prompts, ids)), desc=f"golden {model} {device} {dtype}"):
        x = torch.tensor([pid], device=device)
        res = hf.generate(x, **gen)
        tokens = res.sequences[0, len(pid):]
        if len(tokens) != NEW_TOKENS:
            raise RuntimeError(f"HF stopped after {len(tokens)} tokens on {p['name']!r}")
        prefill_ids, prefill_lp = _topk(hf(x).logits[0], TOP_K)
        decode_ids, decode_lp = _topk(torch.stack(res.logits)[:, 0], TOP_K)
        # HF against itself: the same sequence through eager attention, compared on the golden's top-K ids.
        full = res.sequences
        a = torch.log_softmax(hf(full).logits[0].float(), -1)
        b = torch.log_softmax(hf_eager(full).logits[0].float(), -1)
        idx = a.topk(TOP_K, -1).indices
        spread = max(spread, float((a.gather(-1, idx) - b.gather(-1, idx)).abs().max()))
        out.append(PromptGolden(p["name"], np.array(pid, dtype=np.int32), tokens.int().cpu().numpy(),
                                prefill_ids, prefill_lp, decode_ids, decode_lp))
    dtype_name = str(dtype).removeprefix("torch.")
    prov = provenance(device, **expected_identity(model, device.split(":")[0], dtype_name),
                      top_k=TOP_K, new_tokens=NEW_TOKENS, attention="sdpa",
                      hf_spread_max_abs_logprob=spread,
                      hf_spread_definition="max |logprob(sdpa) - logprob(eager)| over every position of prompt + "
                                           "continuation, on sdpa's top-K ids, all prompts")
    return GoldenSet(out, prov)


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
    dtype = getattr(torch, args.dtype)
    models = args.model or list(GOLDEN_MODELS)
    status = 0
    for model in models:
        folder = golden_dir(model, args.device, args.dtype)
        fresh = make_golden(model, args.device, dtype)
        if args.check:
            committed = load_checked(model, args.device, args.dtype)
            d = drift(committed, fresh)
            ok = d["token_mismatches"] == 0 and d["max_abs_top1_logprob_diff"] <= \
                4 * committed.provenance["hf_spread_max_abs_logprob"]
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
    p.add_argument("--check", action="store_true", help="regenerate in memory and report drift from the committed files")
    p.set_defaults(func=_cmd)
