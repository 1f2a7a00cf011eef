"""The CPU parity gate on a busy machine: the same bits whatever else runs (docs/parity-determinism.md).

Busy processes of the test's own keep every core busy while tiny-qwen3's batch path runs again and again, a new
engine each time as the gate builds it; every run must pass and give the bits of an idle run. STRESS_REPEATS sets
the count (default 3; `nox -s stress` runs 30)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pytest
import torch

from engine.utils.device import physical_cores
from harness import golden as G
from harness.parity.gate import evaluate, tolerance
from harness.parity.paths import PATHS
from harness.parity.run import run_path

MODEL = "tiny-qwen3"
REPEATS = int(os.environ.get("STRESS_REPEATS", "3"))
SPIN = "while True: pass"
MATMUL = "import numpy as np\na = np.random.rand(512, 512)\nwhile True:\n    a = a @ a\n    a /= np.abs(a).max()"


@contextmanager
def busy_cores() -> Iterator[List[subprocess.Popen]]:
    """One spinning process per core and a numpy matmul loop, stopped however the test ends."""
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in [SPIN] * (os.cpu_count() or 1) + [MATMUL]]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def gate_run(gs: G.GoldenSet) -> tuple[bool, str, str]:
    """tiny-qwen3's batch path against its CPU golden: (passed, the worst prompt's line, a digest of every
    position's top-K ids and log-probabilities and every sampled token)."""
    path = next(p for p in PATHS if p.name == "batch")
    stats, outputs, _ = run_path(path, MODEL, "cpu", "float32", gs)
    prompts, path_result = evaluate(path, gs, stats, outputs, tolerance(gs, "float32"))
    digest = hashlib.sha256()
    for uid in sorted(stats):
        for pos in sorted(stats[uid]):
            digest.update(stats[uid][pos].top_ids.tobytes() + stats[uid][pos].top_lp.tobytes())
        digest.update(np.asarray(outputs[uid], dtype=np.int64).tobytes())
    worst = max(prompts, key=lambda p: max(p.max_err_prefill, p.max_err_decode))
    line = f"{worst.prompt}: prefill {worst.max_err_prefill:.3g}, decode {worst.max_err_decode:.3g}"
    passed = all(p.passed for p in prompts) and path_result.passed
    return passed, line, digest.hexdigest()


def test_parity_gate_same_bits_under_load() -> None:
    gs = G.load_checked(MODEL, "cpu", "float32")
    idle_passed, idle_line, idle_bits = gate_run(gs)
    assert idle_passed, f"idle run fails: {idle_line}"
    runs = []
    with busy_cores():
        for _ in range(REPEATS):
            runs.append(gate_run(gs))
    bad = [f"run {i}: {'PASS' if ok else 'FAIL'} {line}, bits {'same' if bits == idle_bits else 'DIFFER'}"
           for i, (ok, line, bits) in enumerate(runs) if not ok or bits != idle_bits]
    assert not bad, f"{len(bad)} of {REPEATS} runs under load differ from the idle run ({idle_line}):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("env", [{"OMP_DYNAMIC": "TRUE", "MKL_DYNAMIC": "TRUE"}, {}])
def test_engine_fixes_threads_whatever_the_environment(env: dict) -> None:
    """An Engine turns OpenMP's and MKL's dynamic threading off and sets its thread count itself, even where the
    environment asks for dynamic teams (a process that did not start through python -m harness or pytest)."""
    code = ("import torch\n"
            "from engine import Engine, EngineConfig\n"
            "from engine.distributed import DistributedInfo\n"
            "from engine.utils.device import physical_cores\n"
            "from engine.utils.threads import dynamic_threading\n"
            "from harness import zoo\n"
            f"e = Engine(EngineConfig(model_path=str(zoo.path({MODEL!r})), tp_info=DistributedInfo(0, 1), "
            "device='cpu', dtype=torch.float32, num_page_override=64, max_seq_len_override=64))\n"
            "print(dynamic_threading(), torch.get_num_threads() == physical_cores())\n"
            "e.shutdown()\n")
    root = Path(__file__).resolve().parent.parent
    full_env = dict(os.environ, PYTHONPATH=str(root), **env)
    for key in {"OMP_DYNAMIC", "MKL_DYNAMIC"} - set(env):
        full_env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout


def test_refreshed_spread_covers_the_thread_counts_and_keeps_a_larger_record(golden_copy: Path) -> None:
    """--refresh-spread measures HF across 1, 2 and all cores' threads and keeps, position by position, a larger value
    recorded before (another machine's) instead of replacing it."""
    G.refresh_spread(MODEL, "cpu", torch.float32, root=golden_copy)
    folder = G.golden_dir(MODEL, "cpu", "float32", golden_copy)
    gs = G.load(folder)
    threads = sorted({1, min(2, physical_cores()), physical_cores()})
    assert gs.provenance["hf_spread_threads"] == threads
    assert gs.provenance["hf_variants"] == [f"{a}, {t} thread{'s' if t > 1 else ''}" for a in ("sdpa", "eager")
                                            for t in threads]
    larger = 2 * gs.provenance["hf_spread"]["err_max"]  # within what float64 allows a setting (hf_off's bound)
    assert larger < gs.provenance["hf_off"]["bound"]
    for field in ("spread_err", "variant_err"):  # as if eager, 1 thread lay that far on another machine
        getattr(gs.prompts[0], field)[2, 5] = larger
    G.save(gs, folder)
    G.refresh_spread(MODEL, "cpu", torch.float32, root=golden_copy)
    after = G.load(folder)
    assert after.prompts[0].spread_err[2, 5] == after.prompts[0].variant_err[2, 5] == np.float32(larger)
    assert after.provenance["hf_spread"]["err_max"] == after.provenance["hf_spread_max_abs_logprob"] == \
        pytest.approx(larger)
    assert after.provenance["hf_off"]["counts"] == {}


@pytest.mark.parametrize("first", ["import engine", "import torch; torch.ones(4, 64) @ torch.ones(64, 8)"])
def test_engine_computes_in_mkls_reproducible_mode(first: str) -> None:
    """MKL in strict conditional-numerical-reproducibility mode (the same GEMM, the same kernel, in every process):
    set when the engine package is imported, checked when an engine starts, and a warning naming the fix where MKL
    computed before it could be set (engine.utils.threads)."""
    code = (f"{first}\n"
            "import logging, torch\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "from engine import Engine, EngineConfig\n"
            "from engine.distributed import DistributedInfo\n"
            "from engine.utils.threads import mkl_cnr_mode\n"
            "from harness import zoo\n"
            f"e = Engine(EngineConfig(model_path=str(zoo.path({MODEL!r})), tp_info=DistributedInfo(0, 1), "
            "device='cpu', dtype=torch.float32, num_page_override=64, max_seq_len_override=64))\n"
            "print('mode', mkl_cnr_mode())\n"
            "e.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(Path(__file__).parent.parent)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if first == "import engine":
        assert "mode AUTO,STRICT" in out.stdout and "reproducibility" not in out.stderr, (out.stdout, out.stderr)
    else:
        assert "mode OFF" in out.stdout, out.stdout
        assert "MKL computes with conditional numerical reproducibility OFF" in out.stderr, out.stderr
