"""The Gemma 3 models of the zoo: the seeded tiny-gemma3 (cheap, always) and the GGUF route of gemma3-270m.

The 238 MB download is never made here: the GGUF checks run on small fake files, and the real model's test runs only
where `python -m harness models prepare gemma3-270m` has been run already."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import List

import pytest
import torch

from harness import UserError, zoo

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Les mathématiques sont", "Hello",
           "Once upon a time in a land far away, there lived a"]


def _greedy(model, tok, text: str, n: int = 8) -> List[int]:
    x = tok(text, return_tensors="pt").input_ids
    out = model.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, x.shape[1]:].tolist()


def test_tiny_gemma3_is_bit_identical_from_its_seed(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    zoo.MODELS["tiny-gemma3"].make(tmp_path / "a")
    zoo.MODELS["tiny-gemma3"].make(tmp_path / "b")
    assert zoo.weights_sha256(tmp_path / "a") == zoo.weights_sha256(tmp_path / "b")
    assert zoo.weights_sha256(tmp_path / "a") == zoo.info("tiny-gemma3")["weights_sha256"]


def test_tiny_gemma3_loads_in_hf_with_its_pattern_and_varied_outputs() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.path("tiny-gemma3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert [t[0] for t in cfg.layer_types] == list("ssfssf")
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.head_dim) == (16, 128, 256)
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    outs = [_greedy(model, tok, p) for p in PROMPTS]
    assert len({tuple(o) for o in outs}) == len(PROMPTS), "different prompts should continue differently"
    for p, o in zip(PROMPTS, outs):
        assert o[0] != tok(p).input_ids[-1], f"{p!r} is echoed: the model does not use its context"
        assert len(set(o)) > 2, f"{p!r} continues with one token repeated: {tok.decode(o)!r}"


def _fake_chunk_wheels(folder: Path) -> None:
    for package, member in zoo.GEMMA3_CHUNKS:
        with zipfile.ZipFile(zoo._wheel(folder, package), "w") as z:
            z.writestr(member, b"not a gguf " + package.encode())


def test_gemma3_join_refuses_chunks_with_a_wrong_sha256(tmp_path: Path) -> None:
    _fake_chunk_wheels(tmp_path)
    with pytest.raises(UserError, match=f"expected {zoo.GEMMA3_GGUF_SHA256}.*ENGINE_ZOO_GEMMA3_GGUF"):
        zoo._assemble_gemma3(tmp_path, tmp_path)
    joined = (tmp_path / zoo.GEMMA3_GGUF).read_bytes()
    assert joined == b"".join(b"not a gguf " + p.encode() for p, _ in zoo.GEMMA3_CHUNKS), "chunks join in order"


def test_gemma3_local_gguf_with_a_wrong_sha256_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / zoo.GEMMA3_GGUF
    fake.write_bytes(b"GGUF but not Gemma")
    monkeypatch.setenv("ENGINE_ZOO_DIR", str(tmp_path / "zoo"))
    monkeypatch.setenv("ENGINE_ZOO_GEMMA3_GGUF", str(fake))
    with pytest.raises(UserError, match=f"{fake} has sha256 .*, expected {zoo.GEMMA3_GGUF_SHA256}"):
        zoo.prepare("gemma3-270m")
    assert not zoo.is_prepared("gemma3-270m")
    assert list((tmp_path / "zoo").iterdir()) == [], "a refused preparation leaves nothing behind"


def test_gemma3_local_gguf_that_is_missing_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_ZOO_DIR", str(tmp_path / "zoo"))
    monkeypatch.setenv("ENGINE_ZOO_GEMMA3_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(UserError, match="ENGINE_ZOO_GEMMA3_GGUF=.*absent.gguf is not a file"):
        zoo.prepare("gemma3-270m")


@pytest.mark.skipif(not zoo.is_prepared("gemma3-270m"),
                    reason="gemma3-270m is not prepared (python -m harness models prepare gemma3-270m, 238 MB)")
def test_gemma3_270m_continues_as_the_real_model() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.path("gemma3-270m")
    tok = AutoTokenizer.from_pretrained(path)
    saved = {p.name for p in path.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))}
    assert saved <= set(zoo.TOKENIZER_FILES), "tokenizer_sha256 must cover every tokenizer file"
    assert (path / "GEMMA_TERMS.html").is_file()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert tok("The capital of France is").input_ids[0] == tok.bos_token_id == 2
    out = tok.decode(_greedy(model, tok, "The capital of France is", 12))
    assert out == " the capital of the country of France. It is the largest"
