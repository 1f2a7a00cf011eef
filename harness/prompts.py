"""The prompt set of a golden: the default set, or the user's file (python -m harness golden --prompts FILE).

The default set is golden/prompts.json, plus golden/prompts-long.json (prompts longer than a window) for a model with
a sliding window; its chat prompt goes through the tokenizer's chat template, and is left out when the tokenizer has
none. A golden records its set (the prompts themselves) and the set's sha256, so parity runs the golden's prompts
without the file; the default set's sha256 is the file's own while the whole file is used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

from harness import UserError
from harness.models import GOLDEN_DIR, ModelRef

PROMPTS_FILE = GOLDEN_DIR / "prompts.json"
LONG_PROMPTS_FILE = GOLDEN_DIR / "prompts-long.json"  # longer than gemma3-270m's 512-token window
NEW_TOKENS = 32  # tokens HF generates after a prompt that does not say how many
DEFAULT = "default"
FORMAT = ('give a JSON list of strings, or JSON lines of {"prompt": "...", "max_new_tokens": N} '
          '("max_new_tokens" and "name" optional)')


@dataclass(frozen=True)
class PromptSet:
    """prompts: each a dict with a name, and text (tokenized as is) or chat (messages through the chat template),
    and max_new_tokens where it is not NEW_TOKENS. source: "default" or the file the set was read from."""

    prompts: List[Dict[str, Any]]
    sha256: str
    source: str = DEFAULT


def _digest(prompts: List[Dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()


def default_set(ref: ModelRef) -> PromptSet:
    files = [PROMPTS_FILE] + ([LONG_PROMPTS_FILE] if ref.config.sliding_window is not None else [])
    prompts = [p for f in files for p in json.loads(f.read_text())["prompts"]]
    kept = prompts if ref.has_chat_template else [p for p in prompts if "chat" not in p]
    if files == [PROMPTS_FILE] and kept == prompts:
        return PromptSet(kept, hashlib.sha256(PROMPTS_FILE.read_bytes()).hexdigest())
    return PromptSet(kept, _digest(kept))


def read_file(path: Path) -> PromptSet:
    """A JSON list of strings (or of objects as below), or JSON lines of {"prompt", "max_new_tokens", "name"}."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"--prompts {path}: cannot read it ({e.strerror}); {FORMAT}") from None
    try:
        whole = json.loads(text)
        items = whole if isinstance(whole, list) else [whole]
        lines: List[int | None] = [None] * len(items)
    except ValueError:
        numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        items, lines = [], []
        for n, line in numbered:
            try:
                items.append(json.loads(line))
            except ValueError as e:
                raise UserError(f"--prompts {path}: line {n} is not JSON ({e}); {FORMAT}") from None
            lines.append(n)
    if not items:
        raise UserError(f"--prompts {path} holds no prompt; {FORMAT}")
    prompts = [_entry(item, i, f"--prompts {path}" + (f": line {n}" if n else ""))
               for i, (item, n) in enumerate(zip(items, lines))]
    names = [p["name"] for p in prompts]
    if len(set(names)) != len(names):
        raise UserError(f"--prompts {path}: two prompts are named {next(n for n in names if names.count(n) > 1)!r}; "
                        "give each prompt its own name")
    return PromptSet(prompts, _digest(prompts), str(path))


def _entry(item: Any, i: int, where: str) -> Dict[str, Any]:
    item = {"prompt": item} if isinstance(item, str) else item
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
        raise UserError(f"{where}: prompt {i} is not a non-empty string or an object with one in \"prompt\"; {FORMAT}")
    unknown = set(item) - {"prompt", "max_new_tokens", "name"}
    if unknown:
        raise UserError(f"{where}: prompt {i} has unknown keys {sorted(unknown)}; {FORMAT}")
    out: Dict[str, Any] = {"name": str(item.get("name", f"prompt-{i}")), "text": item["prompt"]}
    if "max_new_tokens" in item:
        n = item["max_new_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise UserError(f"{where}: prompt {i} has max_new_tokens {n!r}; give a positive integer")
        out["max_new_tokens"] = n
    return out


def recorded(prov: Dict[str, Any]) -> PromptSet | None:
    """The set a golden recorded, if it recorded one (goldens made before sets were recorded: None)."""
    if "prompt_set" not in prov:
        return None
    return PromptSet(prov["prompt_set"], prov["prompt_set_sha256"], prov.get("prompt_source", DEFAULT))


def intact(rec: PromptSet) -> bool:
    """Whether a recorded user's set still hashes to its recorded sha256 (the default set's is its file's)."""
    return rec.source == DEFAULT or _digest(rec.prompts) == rec.sha256


def expected_set(prov: Dict[str, Any], ref: ModelRef) -> PromptSet:
    """The set a golden must have been made from: the default set today, or the user's set it recorded."""
    rec = recorded(prov)
    return rec if rec is not None and rec.source != DEFAULT else default_set(ref)


def new_tokens(prompt: Dict[str, Any]) -> int:
    return int(prompt.get("max_new_tokens", NEW_TOKENS))


def tokenize(tokenizer: Any, prompts: List[Dict[str, Any]]) -> List[List[int]]:
    out = []
    for p in prompts:
        if "chat" in p:
            ids = tokenizer.apply_chat_template(p["chat"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(p["text"]).input_ids
        out.append([int(i) for i in ids])
    return out
