"""Sessions: tests and parity run by default; golden and bench on request (nox -s golden / nox -s bench).

Extra arguments pass through: `nox -s parity -- --model tiny-qwen3`, `nox -s tests -- -k sampler`.
"""

import nox

nox.options.sessions = ["tests", "parity"]
nox.options.reuse_existing_virtualenvs = True


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
def parity(session: nox.Session) -> None:
    """The engine against HF's golden files along every engine path, then the sampler's distribution tests."""
    _install(session)
    session.run("python", "-m", "harness", "parity", *session.posargs)


@nox.session
def golden(session: nox.Session) -> None:
    """Regenerate golden files from HF (or `-- --check` to report drift without writing)."""
    _install(session)
    session.run("python", "-m", "harness", "golden", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Throughput and latency beside HF and the hardware's limit, into reports/bench/<device>/; on the CPU also
    the pytest-benchmark micro-benchmarks (compare a change with --benchmark-compare against their JSON)."""
    _install(session)
    session.run("python", "-m", "harness", "bench", *session.posargs)
    if "cuda" not in " ".join(session.posargs):
        session.run("python", "-m", "pytest", "tests/test_bench_micro.py", "--benchmark-only", "-q",
                    "--benchmark-json=reports/bench/cpu/pytest-benchmark.json")
