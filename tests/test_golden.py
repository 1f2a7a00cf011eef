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


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing-array", "no-provenance",
                                    "decode-lp-shape"])
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
    elif damage == "no-provenance":
        (folder / "provenance.json").unlink()
    else:  # the decode log-probabilities of one prompt a step short of the provenance's new_tokens
        _rewrite(npz, lambda arrays: arrays.update({"3/decode_lp": arrays["3/decode_lp"][:-1]}))
    with pytest.raises(G.GoldenError, match=str(folder)):
        run_parity(MODEL, paths=["batch"], golden_root=golden_copy)


def _rewrite(npz, change) -> None:
    with np.load(npz) as d:
        arrays = {k: d[k] for k in d.files}
    change(arrays)
    np.savez_compressed(npz, **arrays)


@pytest.mark.parametrize("array", G.ARRAYS + ("reference_err", "variant_err", "spread_kl"))
@pytest.mark.parametrize("damage", ["row-short", "wrong-dtype"])
def test_every_array_is_checked_against_the_provenance(golden_copy, array, damage):
    """Each array of a prompt, one row short (or a column short, for the prompt and the continuation; a setting short,
    for HF's settings' runs) or of the other kind (float ids, integer log-probabilities), is refused, naming the file
    and the array."""
    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)
    key = f"3/{array}"

    def change(arrays):
        a = arrays[key]
        if damage == "row-short":
            arrays[key] = a[:-1]
        else:
            arrays[key] = a.astype(np.int32 if a.dtype.kind == "f" else np.float32)

    _rewrite(folder / "golden.npz", change)
    named = "prefill_ids" if (array, damage) == ("prompt_ids", "row-short") else array  # P is the prompt's length
    with pytest.raises(G.GoldenError, match=rf"{folder}.*prompt '.*': {named} is "):
        G.load(folder)


def test_a_golden_shorter_than_its_provenance_is_refused(golden_copy):
    """The continuation, its decode ids and log-probabilities all one step short agree with each other, but not with
    the provenance's new_tokens."""
    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)

    def change(arrays):
        for k in ("tokens", "decode_ids", "decode_lp"):
            arrays[f"0/{k}"] = arrays[f"0/{k}"][:-1]

    _rewrite(folder / "golden.npz", change)
    with pytest.raises(G.GoldenError, match=r"tokens is int32 of shape \(31,\).*shape \(32,\)"):
        run_parity(MODEL, paths=["batch"], golden_root=golden_copy)


def test_an_array_of_no_prompt_is_refused(golden_copy):
    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)
    _rewrite(folder / "golden.npz", lambda arrays: arrays.update({"99/tokens": arrays["0/tokens"]}))
    with pytest.raises(G.GoldenError, match=r"99/tokens.*belong to no prompt"):
        G.load(folder)


def test_regeneration_rewrites_the_golden(golden_copy):
    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)
    committed = G.load(folder)
    (folder / "golden.npz").write_bytes(b"stale")
    G.save(G.make_golden(MODEL), folder)
    fresh = G.load(folder)
    assert G.drift(committed, fresh)["token_mismatches"] == 0
    assert run_parity(MODEL, paths=["batch"], golden_root=golden_copy).passed


FLOAT64 = ("reference_err", "reference_kl", "variant_err", "variant_kl")  # what the float64 run measures


def _strip_reference(folder) -> dict:
    """The golden as it was before the float64 reference: its arrays and provenance without it."""
    gs = G.load(folder)
    for p in gs.prompts:
        for field in FLOAT64:
            setattr(p, field, None)
    for key in [k for k in gs.provenance if k.startswith("hf_reference") or k.startswith("hf_off")]:
        del gs.provenance[key]
    G.save(gs, folder)
    return json.loads((folder / "provenance.json").read_text())


def test_a_golden_without_its_float64_reference_is_refused_then_the_command_adds_it(golden_copy, capsys):
    from harness.__main__ import main

    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)
    before = _strip_reference(folder)
    arrays = {k: v.copy() for k, v in np.load(folder / "golden.npz").items()}
    argv = ["parity", "--model", MODEL, "--golden-dir", str(golden_copy), "--path", "batch", "--no-sampling",
            "--no-report"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    command = f"python -m harness golden --add-reference --model {MODEL} --device cpu --dtype float32 --golden-dir " \
              f"{golden_copy}"
    assert err.startswith("error: ") and "\n" not in err and err.endswith(command), err
    assert main(command.split()[3:]) == 0
    after = json.loads((folder / "provenance.json").read_text())
    kept = [k for k in before if not k.startswith("hf_")] + ["hf_variants", "hf_router_near_ties"]
    assert {k: after.get(k) for k in kept} == {k: before.get(k) for k in kept}, "the golden's identity kept"
    assert after["hf_reference"]["positions"] == sum(len(p.prompt_ids) + len(p.tokens) - 1
                                                     for p in G.load(folder).prompts)
    assert after["hf_off"]["counts"] == {}
    data = np.load(folder / "golden.npz")
    rows = [k for k in arrays if k.split("/")[1] in G.ARRAYS]
    assert rows and all(np.array_equal(data[k], arrays[k]) for k in rows), "the golden's rows kept"
    assert {k.split("/")[1] for k in set(data.files) - set(arrays)} == set(FLOAT64)
    assert main(argv) == 0


def test_every_committed_golden_names_the_tokenizer_its_zoo_model_prepares_to():
    """A GPU golden is refused on the card when the prepared folder's tokenizer files differ from the ones it
    recorded; the files must not follow the transformers version that prepared them (nor the device)."""
    from harness import zoo
    from harness.golden_files import GOLDEN_DIR

    recorded = {}
    for prov in sorted(GOLDEN_DIR.glob("**/provenance.json")):
        model = json.loads(prov.read_text())
        if model["model"] in zoo.MODELS and zoo.is_prepared(model["model"]):
            recorded[str(prov.parent.relative_to(GOLDEN_DIR))] = (model["tokenizer_sha256"],
                                                                 zoo.tokenizer_sha256(zoo.path(model["model"])))
    assert recorded and {k: v for k, v in recorded.items() if v[0] != v[1]} == {}
