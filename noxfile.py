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
