"""The exit status every verb gives, the contract a CI gates on: 0 pass, 1 a finding, 2 a user error (one `error:`
line), 3 an internal error (its traceback kept). Each path is driven through harness.__main__.main or the real entry
point; the findings are real ones (a planted fault in the engine, the sampler, a side of an A/B run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import harness
import harness.__main__ as cli
from harness.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
NO_SUCH_GPU = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def test_the_codes_are_defined_once_and_documented():
    assert (harness.EXIT_PASS, harness.EXIT_FINDING, harness.EXIT_USER_ERROR, harness.EXIT_INTERNAL_ERROR) == (0, 1, 2, 3)
    for code, word in ((0, "pass"), (1, "a finding"), (2, "a user error"), (3, "an internal error")):
        assert re.search(rf"^  {code}  {word}", cli.__doc__, re.M), f"exit status {code} undocumented"


def test_pass_is_0():
    assert main(["models", "path", "tiny-qwen3"]) == 0


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)


def test_parity_through_a_pipe_passes_with_0_plain_progress_and_junit(tmp_path):
    """The real entry point with its output piped, as in CI: exit status 0, a line for the path as it ends, no
    carriage return or escape code anywhere, and a JUnit testcase without a failure."""
    out = _run("parity", "--model", "tiny-qwen3", "--path", "batch", "--no-sampling", "--no-report",
               "--junit", str(tmp_path / "junit.xml"))
    assert out.returncode == 0, out.stderr[-3000:]
    for stream in (out.stdout, out.stderr):
        assert "\r" not in stream and "\x1b" not in stream, repr(stream[:2000])
    assert re.search(r"^parity tiny-qwen3 cpu float32 batch +PASS +\d+\.\d s$", out.stderr, re.M), out.stderr
    cases = ET.parse(tmp_path / "junit.xml").getroot().findall("./testsuite/testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [("parity.tiny-qwen3.cpu-float32", "batch")]
    assert cases[0].find("failure") is None and float(cases[0].get("time")) > 0


def test_a_parity_fail_is_1_and_its_junit_failure_says_where(tmp_path, monkeypatch, capsys):
    from engine.kvcache import KVCachePool

    store = KVCachePool.store_kv
    monkeypatch.setattr(KVCachePool, "store_kv", lambda self, kv, out_loc, layer: store(self, kv, out_loc + 1, layer))
    junit = tmp_path / "junit.xml"
    assert main(["parity", "--model", "tiny-qwen3", "--path", "batch", "--no-sampling", "--no-report",
                 "--junit", str(junit)]) == 1
    assert re.search(r"^parity tiny-qwen3 cpu float32 batch +FAIL", capsys.readouterr().err, re.M)
    failure = ET.parse(junit).getroot().find("./testsuite/testcase/failure")
    assert failure.get("message").startswith("first failure: model tiny-qwen3, dtype float32, path batch, prompt ")
    assert failure.text.startswith(failure.get("message")) and "the engine's result: " in failure.text


def test_a_sampling_fail_is_1_and_each_failing_row_is_a_junit_failure(tmp_path, monkeypatch):
    """The sampler's filter planted with temperature ignored: the rows at another temperature fail."""
    import engine.sample

    honest = engine.sample.filtered_probs
    monkeypatch.setattr(engine.sample, "filtered_probs",
                        lambda logits, t, k, p, m=None: honest(logits, torch.ones_like(t), k, p, m))
    junit = tmp_path / "junit.xml"
    assert main(["sampling", "--no-real", "--out", str(tmp_path), "--junit", str(junit)]) == 1
    cases = ET.parse(junit).getroot().findall("./testsuite/testcase")
    failed = {c.get("classname") + " " + c.get("name"): c.find("failure") for c in cases if c.find("failure") is not None}
    assert "sampling.cpu.temperature row 1: t=0.5" in failed, sorted(failed)
    assert "sampling.cpu.temperature row 0: t=1" not in failed
    assert failed["sampling.cpu.temperature row 1: t=0.5"].get("message").startswith(
        "sampling case temperature row 1 (t=0.5): ")


# ------------------------------------------------------------------------------------------------ user errors: 2
def _one_error_line(capsys: pytest.CaptureFixture, *words: str) -> None:
    """stderr ends in one `error:` line; only progress lines (a model prepared first, say) may come before it."""
    lines = capsys.readouterr().err.strip().splitlines()
    err = lines[-1] if lines else ""
    assert err.startswith("error: ") and "; " in err, lines
    assert not any(line.startswith(("error", "Traceback", "internal error")) for line in lines[:-1]), lines
    assert all(w in err for w in words), err


USER_ERRORS = {
    "an unknown revision": (["bench", "--against", "nosuchref"], ["--against nosuchref", "a git revision"]),
    "a GPU this machine lacks": (["bench", "--against", "HEAD", "--device", NO_SUCH_GPU], [f"--device {NO_SUCH_GPU}"]),
    "one round": (["bench", "--against", "HEAD", "--rounds", "1"], ["--rounds 1", "give --rounds 2 or more"]),
    "no repeat": (["bench", "--against", "HEAD", "--repeats", "0"], ["--repeats 0"]),
    "a negative threshold": (["bench", "--against", "HEAD", "--fail-if-slower", "-1"], ["--fail-if-slower -1"]),
    "a threshold without a revision": (["bench", "--fail-if-slower", "5"], ["--fail-if-slower", "--against REF"]),
    "MoE and dense models in one run": (["bench", "--model", "tiny-qwen3-moe", "--model", "tiny-qwen3", "--no-hf"],
                                        ["mixture-of-experts"]),
    "a TP size that does not divide the heads": (["parity", "--tp", "3", "--model", "tiny-qwen3", "--no-sampling"],
                                                 ["--tp 3 does not fit tiny-qwen3"]),
    "a sampling cost cap of 0": (["sampling", "--no-real", "--max-cost", "0"], ["--max-cost 0"]),
    "a golden of a model without weights": (["golden", "--model", "qwen3-0.6b"], ["qwen3-0.6b", "has no weights"]),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_a_user_error_is_2_in_one_line(case, capsys):
    argv, words = USER_ERRORS[case]
    assert main(argv) == 2
    _one_error_line(capsys, *words)


def test_a_folder_without_a_checkout_is_refused(tmp_path, capsys):
    assert main(["bench", "--against", str(tmp_path)]) == 2
    _one_error_line(capsys, "holds no checkout of this project")


@pytest.mark.parametrize("verb", [["parity", "--model", "tiny-qwen3", "--no-sampling"], ["sampling", "--no-real"],
                                  ["fuzz"]])
def test_a_junit_file_that_is_a_folder_is_refused(verb, tmp_path, capsys):
    assert main([*verb, "--junit", str(tmp_path)]) == 2
    _one_error_line(capsys, f"--junit {tmp_path} is a folder")


def test_a_report_folder_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["sampling", "--no-real", "--out", str(tmp_path / "file")]) == 2
    _one_error_line(capsys, "is a file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path runs on this machine")
def test_a_gpu_path_on_the_cpu_is_refused(capsys):
    assert main(["parity", "--model", "tiny-qwen3", "--path", "torch-backend", "--no-sampling"]) == 2
    _one_error_line(capsys, "--path torch-backend: runs only on a GPU")


def test_golden_takes_a_gpu_index_as_the_other_verbs_do(capsys):
    """cuda:0 is a device golden accepts; then what follows is this machine's answer, not argparse's refusal."""
    assert main(["golden", "--device", "cuda:0", "--model", "tiny-qwen3", "--dtype", "float16", "--check"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" not in err
    assert ("no golden for tiny-qwen3 on cuda in float16" if torch.cuda.is_available() else
            "--device cuda:0: CUDA is not available") in err, err


def test_the_entry_point_exits_2_with_one_line():
    out = _run("bench", "--against", "nosuchref")
    assert out.returncode == 2 and out.stderr.startswith("error: --against nosuchref") and \
        out.stderr.count("\n") == 1, out.stderr


# ------------------------------------------------------------------------------------------------ internal: 3
def test_an_internal_error_is_3_with_its_traceback(monkeypatch, capsys):
    from harness.bench import run

    def broken(*args, **kwargs):
        raise RuntimeError("an internal failure")

    monkeypatch.setattr(run, "run_bench", broken)
    assert main(["bench", "--model", "tiny-qwen3", "--no-hf"]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: an internal failure" in err
    assert err.strip().splitlines()[-1].startswith("internal error: ")
    assert "error: an internal failure" not in err  # not made a user error
