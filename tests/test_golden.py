"""The golden files' lifecycle: a missing golden fails, a match passes, drift fails and leaves the golden untouched,
a mismatched or corrupt golden is refused with a message that names it, regeneration rewrites."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from harness import golden as G
from harness.parity.run import run_parity

MODEL = "tiny-qwen3"


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_missing_golden_fails(tmp_path):
    with pytest.raises(G.GoldenError, match=r"no golden for tiny-qwen3 on cpu in float32 .* python -m harness golden"):
        run_parity(MODEL, paths=["batch"], golden_root=tmp_path)


def test_matching_golden_passes(golden_copy):
    assert run_parity(MODEL, paths=["batch"], golden_root=golden_copy).passed


def test_drift_fails_and_leaves_the_golden_untouched(golden_copy):
    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)
    gs = G.load(folder)
    gs.prompts[2].decode_lp[5, 0] -= 0.05  # HF "said" something else at one decode position
    G.save(gs, folder)
    before = digest(folder / "golden.npz")
    result = run_parity(MODEL, paths=["batch"], golden_root=golden_copy, obtained_root=golden_copy)
    assert not result.passed
    bad = [p for p in result.prompts if not p.passed]
    assert [p.prompt for p in bad] == [gs.prompts[2].name] and "logprob error" in bad[0].reason
    assert digest(folder / "golden.npz") == before
    assert (folder / "golden.obtained.npz").is_file() and (folder / "provenance.obtained.json").is_file()


@pytest.mark.parametrize("key", ["weights_sha256", "tokenizer_sha256", "prompt_set_sha256", "dtype", "device_type"])
def test_golden_made_for_something_else_is_refused(golden_copy, key):
    prov_file = G.golden_dir(MODEL, "cpu", "float32", golden_copy) / "provenance.json"
    prov = json.loads(prov_file.read_text())
    prov[key] = "something-else"
    prov_file.write_text(json.dumps(prov))
    with pytest.raises(G.GoldenError, match=rf"(?s){key}: golden has 'something-else'.*regenerate it: python -m harness "
                                            rf"golden --model tiny-qwen3 --device cpu --dtype float32"):
        run_parity(MODEL, paths=["batch"], golden_root=golden_copy)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing-array", "no-provenance"])
def test_corrupt_golden_is_refused_naming_the_file(golden_copy, damage):
    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)
    npz = folder / "golden.npz"
    if damage == "garbage":
        npz.write_bytes(b"not a zip file")
    elif damage == "truncated":
        npz.write_bytes(npz.read_bytes()[:1000])
    elif damage == "missing-array":
        with np.load(npz) as d:
            arrays = {k: d[k] for k in d.files if k != "3/decode_lp"}
        np.savez_compressed(npz, **arrays)
    else:
        (folder / "provenance.json").unlink()
    with pytest.raises(G.GoldenError, match=str(folder)):
        run_parity(MODEL, paths=["batch"], golden_root=golden_copy)


def test_regeneration_rewrites_the_golden(golden_copy):
    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)
    committed = G.load(folder)
    (folder / "golden.npz").write_bytes(b"stale")
    G.save(G.make_golden(MODEL), folder)
    fresh = G.load(folder)
    assert G.drift(committed, fresh)["token_mismatches"] == 0
    assert run_parity(MODEL, paths=["batch"], golden_root=golden_copy).passed
