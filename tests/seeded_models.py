"""Seeded model folders of shapes the zoo does not have, for the tests that run the engine on models it was never
tuned on (tests/test_gate_specificity.py, tests/test_process_determinism.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from harness import zoo

ARCHS = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config"}


def seeded_folder(folder: Path, arch: str, seed: int, **config: Any) -> Path:
    """A model of architecture `arch` drawn from torch's generator at `seed` (HF's own init, normal x
    initializer_range), saved as save_pretrained saves it, with SmolLM2's tokenizer."""
    import transformers

    cfg = getattr(transformers, ARCHS[arch])(**dict(dict(vocab_size=49152, max_position_embeddings=4096,
                                                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                                                         pad_token_id=2), **config), architectures=[arch])
    torch.manual_seed(seed)
    getattr(transformers, arch)(cfg).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(zoo.TOKENIZER_ASSET / name, folder / name)
    return folder
