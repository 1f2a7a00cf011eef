"""Reading Hugging Face configs and tokenizers from a local folder (never a hub)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


def check_model_dir(path: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"no model at {path!r}: expected a folder with config.json and *.safetensors "
            "(prepare one with `python -m harness models prepare NAME`)")
    return p


@functools.lru_cache(maxsize=16)
def cached_load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(check_model_dir(path), local_files_only=True)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_model_dir(path), local_files_only=True)
