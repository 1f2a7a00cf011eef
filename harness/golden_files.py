"""Golden files on disk, and the identity a golden must match before anything compares with it.

<root>/<model>/<device>-<dtype>/golden.npz      per prompt: prompt ids, the greedy continuation, and at every prefill
                                               and decode position the top-K log-probabilities with their token ids;
                                               at every golden position, HF's runs measured (harness.golden_reference):
                                               reference_err / _kl (the golden's rows against float64), variant_err /
                                               _kl (each of HF's other settings against float64), spread_err / _kl
                                               (each against the golden's rows), router_near_tie (MoE models)
<root>/<model>/<device>-<dtype>/provenance.json versions, device, dtype, weights / tokenizer / prompt-set hashes, the
                                               prompt set itself, HF's settings measured (hf_variants), the referee's
                                               verdict on them (harness.hf_referee: HF's spread and distance to
                                               float64 where it agrees with float64, and where it does not), the command

<root> is the repository's golden/ unless --golden-dir says otherwise. Every array is checked against the shapes the
provenance gives; a golden made for other weights, tokenizer, prompts, dtype or device is refused with the command
that makes it again. harness.golden re-exports all of it.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from harness import UserError
from harness import prompts as P
from harness.models import GOLDEN_DIR, ModelRef, as_model, name_of

# A golden made under other values of these is not comparable: refuse, and say how to regenerate.
IDENTITY_KEYS = ("model", "dtype", "device_type", "weights_sha256", "tokenizer_sha256", "prompt_set_sha256")
ARRAYS = ("prompt_ids", "tokens", "prefill_ids", "prefill_lp", "decode_ids", "decode_lp")
REFERENCE_ARRAYS = ("reference_err", "reference_kl")  # [P + T - 1] per prompt, in a golden with a float64 reference
VARIANT_ARRAYS = ("variant_err", "variant_kl", "spread_err", "spread_kl")  # [V, P + T - 1]: V = len(hf_variants)
HF_ARRAYS = REFERENCE_ARRAYS + VARIANT_ARRAYS + ("router_near_tie",)  # what golden_reference measures, all optional


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
    reference_err: np.ndarray | None = None  # [P + T - 1] HF's distance to float64 at each position with a row
    reference_kl: np.ndarray | None = None
    variant_err: np.ndarray | None = None  # [V, P + T - 1] each of HF's settings against float64 (NaN: unmeasured)
    variant_kl: np.ndarray | None = None
    spread_err: np.ndarray | None = None  # [V, P + T - 1] each of them against the golden's rows
    spread_kl: np.ndarray | None = None
    router_near_tie: np.ndarray | None = None  # [P + T - 1] bool: a router near tie in any of HF's runs (MoE)


@dataclass
class GoldenSet:
    prompts: List[PromptGolden]
    provenance: Dict[str, Any]
    reference_command: str = ""  # what adds a float64 reference to this golden (load_checked sets it)


def golden_dir(model: ModelRef | str, device_type: str, dtype: str, root: Path | None = None) -> Path:
    """root: the goldens' root (default: the model's, for a name the repository's golden/)."""
    root = root if root is not None else model.golden_root if isinstance(model, ModelRef) else GOLDEN_DIR
    return Path(root) / name_of(model) / f"{device_type}-{dtype}"


def regenerate_command(model: ModelRef | str, device_type: str, dtype: str, root: Path | None = None,
                       prompts: P.PromptSet | None = None) -> str:
    named = model.args if isinstance(model, ModelRef) else f"--model {model}"
    root = root if root is not None else model.golden_root if isinstance(model, ModelRef) else GOLDEN_DIR
    return (f"python -m harness golden {named} --device {device_type} --dtype {dtype}" +
            ("" if Path(root) == GOLDEN_DIR else f" --golden-dir {root}") +
            ("" if prompts is None or prompts.source == P.DEFAULT else f" --prompts {prompts.source}"))


def reference_command(model: ModelRef | str, device_type: str, dtype: str, root: Path | None = None) -> str:
    """The command that adds HF's distance to float64 to an existing golden (harness.golden_reference)."""
    named = model.args if isinstance(model, ModelRef) else f"--model {model}"
    root = root if root is not None else model.golden_root if isinstance(model, ModelRef) else GOLDEN_DIR
    return (f"python -m harness golden --add-reference {named} --device {device_type} --dtype {dtype}" +
            ("" if Path(root) == GOLDEN_DIR else f" --golden-dir {root}"))


def expected_identity(model: ModelRef | str, device_type: str, dtype: str,
                      prompts: P.PromptSet | None = None) -> Dict[str, str]:
    """What a golden of this model, device type and dtype must record; prompts: its set (default: the default)."""
    ref = as_model(model)
    return {"model": ref.name, "dtype": dtype, "device_type": device_type, "weights_sha256": ref.weights_sha256(),
            "tokenizer_sha256": ref.tokenizer_sha256(),
            "prompt_set_sha256": (prompts or P.default_set(ref)).sha256}


def save(gs: GoldenSet, folder: Path, stem: str = "golden") -> None:
    """stem "golden.obtained" writes an engine's result beside the golden, in the same format."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays: Dict[str, np.ndarray] = {}
    for i, p in enumerate(gs.prompts):
        for field in ARRAYS + HF_ARRAYS:
            if getattr(p, field) is not None:
                arrays[f"{i}/{field}"] = getattr(p, field)
    np.savez_compressed(folder / f"{stem}.npz", **arrays)
    prov = dict(gs.provenance, prompt_names=[p.name for p in gs.prompts])
    (folder / f"{stem.replace('golden', 'provenance')}.json").write_text(json.dumps(prov, indent=2) + "\n")


def load(folder: Path) -> GoldenSet:
    """The golden in folder, every array checked against the shapes its provenance gives."""
    npz, prov_file = folder / "golden.npz", folder / "provenance.json"
    for f in (npz, prov_file):
        if not f.is_file():
            raise GoldenError(f"missing golden file {f}")
    try:
        prov = json.loads(prov_file.read_text())
        names = prov["prompt_names"]
        with np.load(npz) as data:
            extra = set(data.files) - {f"{i}/{k}" for i in range(len(names)) for k in ARRAYS + HF_ARRAYS}
            if extra:
                raise KeyError(f"arrays {sorted(extra)} belong to no prompt of provenance.json")
            prompts = [PromptGolden(name, *(data[f"{i}/{k}"] for k in ARRAYS),
                                    *(data[f"{i}/{k}"] if f"{i}/{k}" in data.files else None for k in HF_ARRAYS))
                       for i, name in enumerate(names)]
        new_tokens = _new_tokens(prov, len(names))
        top_k = int(prov["top_k"])
    except (ValueError, KeyError, OSError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise GoldenError(f"corrupt golden file in {folder}: {type(e).__name__}: {e}; regenerate it") from e
    for p, t in zip(prompts, new_tokens):
        _check_shapes(p, t, top_k, len(prov.get("hf_variants", [])), npz)
    return GoldenSet(prompts, prov)


def _new_tokens(prov: Dict[str, Any], n: int) -> List[int]:
    """Per prompt, the continuation's length the provenance gives: its recorded set's, else new_tokens."""
    rec = P.recorded(prov)
    if rec is None:
        return [int(prov["new_tokens"])] * n
    if not P.intact(rec):
        raise ValueError("the recorded prompt set does not hash to its prompt_set_sha256")
    if [p["name"] for p in rec.prompts] != prov["prompt_names"]:
        raise ValueError("prompt_names are not the recorded prompt set's names")
    return [P.new_tokens(p) for p in rec.prompts]


def _check_shapes(p: PromptGolden, t: int, k: int, v: int, npz: Path) -> None:
    """Every array of a prompt against [P] for the prompt, [T] for the continuation, [P, K] and [T, K] for the top-K
    ids (integers) and log-probabilities (floats), [P + T - 1] and [V, P + T - 1] for HF's runs measured; T, K and V
    (hf_variants) from the provenance, P from the prompt's ids."""
    n = p.prompt_ids.shape[0] if p.prompt_ids.ndim == 1 and p.prompt_ids.size else -1
    want = {"prompt_ids": (n, "i"), "tokens": (t, "i"), "prefill_ids": (n, k, "i"), "prefill_lp": (n, k, "f"),
            "decode_ids": (t, k, "i"), "decode_lp": (t, k, "f")}
    want.update({f: (n + t - 1, "f") for f in REFERENCE_ARRAYS})
    want.update({f: (v, n + t - 1, "f") for f in VARIANT_ARRAYS})
    want["router_near_tie"] = (n + t - 1, "b")
    names = {"i": "integers", "f": "floats", "b": "booleans"}
    for field, (*shape, kind) in want.items():
        a = getattr(p, field)
        if a is not None and (a.shape != tuple(shape) or a.dtype.kind != kind):
            raise GoldenError(f"corrupt golden file {npz}: prompt {p.name!r}: {field} is {a.dtype} of shape "
                              f"{a.shape}, where the provenance gives {names[kind]} of shape {tuple(shape)} "
                              f"(top_k {k}, {t} new tokens, {v} HF variants, P = the prompt's length); regenerate it")


def check_identity(gs: GoldenSet, expected: Dict[str, str], folder: Path, command: str | None = None) -> None:
    """Refuse a golden made for another model, weights, tokenizer, prompt set, dtype or device."""
    bad = [f"{k}: golden has {gs.provenance.get(k)!r}, here {v!r}" for k, v in expected.items()
           if gs.provenance.get(k) != v]
    if bad:
        cmd = command or regenerate_command(expected["model"], expected["device_type"], expected["dtype"])
        raise GoldenError(f"golden {folder} was made for something else:\n  " + "\n  ".join(bad) +
                          f"\nIf the change is intended, regenerate it: {cmd}")


def load_checked(model: ModelRef | str, device_type: str, dtype: str, root: Path | None = None,
                 prompts: P.PromptSet | None = None) -> GoldenSet:
    """The golden of the model (under root, default: the model's golden root), refused unless it was made from
    these weights, tokenizer and prompts (default: the set it recorded if the user's, else the default set)."""
    folder = golden_dir(model, device_type, dtype, root)
    if not folder.exists():
        raise GoldenError(f"no golden for {name_of(model)} on {device_type} in {dtype} ({folder} is missing); make "
                          f"it with: {regenerate_command(model, device_type, dtype, root, prompts)}")
    gs = load(folder)
    ref = as_model(model, root)
    pset = prompts or P.expected_set(gs.provenance, ref)
    check_identity(gs, expected_identity(ref, device_type, dtype, pset), folder,
                   regenerate_command(ref, device_type, dtype, prompts=pset))
    gs.reference_command = reference_command(ref, device_type, dtype)
    return gs
