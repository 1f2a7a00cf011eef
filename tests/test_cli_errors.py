"""What a new user gets wrong ends in one line, `error: <what is wrong>; <what to do>`, exit status 2: each verb
checks what it was asked for before any work starts. -v keeps the traceback; an internal error keeps it always."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.__main__ import main, one_line

# a GPU this machine does not have: plain cuda without CUDA, one past the last GPU with it
NO_SUCH_GPU = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
ROOT = Path(__file__).resolve().parent.parent


def one_error_line(capsys: pytest.CaptureFixture, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and "; " in err, err
    assert all(w in err for w in words), err
    return err


def test_models_unknown_name(capsys):
    assert main(["models", "path", "no-such-model"]) == 2
    one_error_line(capsys, "unknown model 'no-such-model'", "tiny-qwen3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_golden_on_a_machine_without_cuda(capsys):
    assert main(["golden", "--device", "cuda", "--model", "tiny-qwen3"]) == 2
    one_error_line(capsys, "--device cuda: CUDA is not available", "use --device cpu")


def test_golden_check_without_a_committed_golden_is_refused_before_hf_runs(capsys):
    assert main(["golden", "--check", "--model", "tiny-qwen3", "--dtype", "float16"]) == 2
    one_error_line(capsys, "no golden for tiny-qwen3 on cpu in float16", "python -m harness golden")


def test_parity_on_a_missing_gpu(capsys):
    assert main(["parity", "--device", NO_SUCH_GPU, "--model", "tiny-qwen3", "--no-sampling"]) == 2
    one_error_line(capsys, f"--device {NO_SUCH_GPU}", "use ")


def test_parity_without_a_golden_is_refused_before_it_runs(capsys):
    assert main(["parity", "--model", "tiny-qwen3", "--dtype", "float16", "--no-sampling"]) == 2
    one_error_line(capsys, "no golden for tiny-qwen3 on cpu in float16", "python -m harness golden")


def test_sampling_on_a_missing_gpu(capsys):
    assert main(["sampling", "--device", NO_SUCH_GPU, "--no-real"]) == 2
    one_error_line(capsys, f"--device {NO_SUCH_GPU}")


def test_bench_on_a_missing_gpu(capsys):
    assert main(["bench", "--device", NO_SUCH_GPU, "--model", "tiny-qwen3", "--no-hf"]) == 2
    one_error_line(capsys, f"--device {NO_SUCH_GPU}")


def test_argparse_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["parity", "--model", "no-such-model"])
    assert exit_.value.code == 2
    one_error_line(capsys, "invalid choice: 'no-such-model'", "python -m harness parity --help")


def test_verbose_keeps_the_traceback(capsys):
    assert main(["-v", "bench", "--device", NO_SUCH_GPU]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "check_device" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_a_message_of_several_lines_becomes_one():
    msg = "golden g was made for something else:\n  dtype: golden has 'a', here 'b'\n  model: x\nregenerate it: cmd"
    assert one_line(msg) == "golden g was made for something else: dtype: golden has 'a', here 'b'; model: x; " \
                            "regenerate it: cmd"


def test_python_dash_m_harness_prints_the_line():
    """Through the real entry point, where __main__ is not harness.__main__: the error type is still recognized."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "harness", "sampling", "--device", NO_SUCH_GPU, "--no-real"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().startswith("error: --device") and "\n" not in out.stderr.strip(), out.stderr


def test_fuzz_on_a_missing_gpu(capsys):
    assert main(["fuzz", "--device", NO_SUCH_GPU]) == 2
    one_error_line(capsys, f"--device {NO_SUCH_GPU}")


def test_fuzz_without_a_golden_is_refused_before_it_runs(capsys):
    assert main(["fuzz", "--dtype", "float16"]) == 2
    one_error_line(capsys, "no golden for tiny-qwen3 on cpu in float16", "python -m harness golden")


def test_fuzz_plants_a_cuda_fault_only_on_cuda(capsys):
    assert main(["fuzz", "--plant", "graph-plan-keyed-on-rows"]) == 2
    one_error_line(capsys, "--plant graph-plan-keyed-on-rows", "use --device cuda")


def test_fuzz_replay_of_a_file_that_is_no_case(capsys, tmp_path):
    (tmp_path / "case.json").write_text("{}")
    assert main(["fuzz", "--replay", str(tmp_path / "case.json")]) == 2
    one_error_line(capsys, "is not a fuzz case", "give the JSON file")


def test_sampling_with_a_real_model_this_machine_cannot_get(capsys, monkeypatch, tmp_path):
    """A real model's cases whose weights cannot be downloaded (no package index) and are not in the zoo cache: one
    line before the grid starts, naming the model, the ways to get it and the flags that leave its cases out."""
    from harness import zoo

    def no_index(cmd, **kw):
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setenv("ENGINE_ZOO_DIR", str(tmp_path))
    monkeypatch.delenv("ENGINE_ZOO_GEMMA3_GGUF", raising=False)
    monkeypatch.setattr(zoo.subprocess, "run", no_index)
    monkeypatch.setattr("harness.sampling.run.run_grid", lambda *a, **k: pytest.fail("the grid started"))
    assert main(["sampling", "--real-model", "gemma3-270m"]) == 2
    one_error_line(capsys, "could not download", "gemma3-270m", "ENGINE_ZOO_GEMMA3_GGUF", "--no-real")


@pytest.mark.parametrize("what", ["missing", "bad checksum"])
@pytest.mark.parametrize("model, env", [("smollm2-135m", "ENGINE_ZOO_GGUF"), ("gemma3-270m", "ENGINE_ZOO_GEMMA3_GGUF")])
def test_a_local_gguf_that_is_missing_or_corrupt_is_one_line(capsys, monkeypatch, tmp_path, what, model, env):
    """The zoo's GGUF given by its environment variable: a path that is no file, or a file whose sha256 is not the
    model's, ends in one line naming the variable (exit status 2), not a traceback."""
    gguf = tmp_path / "model.gguf"
    if what == "bad checksum":
        gguf.write_bytes(b"GGUF, but not this model's")
    monkeypatch.setenv("ENGINE_ZOO_DIR", str(tmp_path / "zoo"))
    monkeypatch.setenv(env, str(gguf))
    assert main(["models", "prepare", model]) == 2
    one_error_line(capsys, env, *(["is not a file"] if what == "missing" else ["has sha256", "corrupt"]))
