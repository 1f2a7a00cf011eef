"""Where reports go: a plain run of parity, sampling or bench writes under build/reports/ (git-ignored) and leaves
the committed reports/ alone; --update-reports writes the committed reports/, in the same layout."""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import pytest

from harness import report
from harness.__main__ import main
from harness.bench.report import write_bench_report
from harness.sampling import run as sampling
from harness.sampling.cases import small_cases

Roots = Tuple[Path, Path]


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Roots:
    """(committed, build) report roots moved under tmp_path, so that no test touches the real reports/."""
    committed, build = tmp_path / "reports", tmp_path / "build" / "reports"
    monkeypatch.setattr(report, "REPORTS_DIR", committed)
    monkeypatch.setattr(report, "BUILD_REPORTS_DIR", build)
    return committed, build


@pytest.fixture
def one_sampling_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampling grid cut to its first small case: these tests are about where the report goes."""
    monkeypatch.setattr(sampling, "all_cases", lambda real_models=(): small_cases()[:1])


def files(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_the_default_root_is_git_ignored() -> None:
    assert report.report_root(update=True) == report.REPO_ROOT / "reports"
    assert report.report_root(update=False) == report.REPO_ROOT / "build" / "reports"
    assert "/build/" in (report.REPO_ROOT / ".gitignore").read_text().splitlines()


def test_plain_parity_run_writes_under_build_reports(roots: Roots, capsys: pytest.CaptureFixture) -> None:
    committed, build = roots
    assert main(["parity", "--model", "tiny-qwen3", "--path", "batch", "--no-sampling"]) == 0
    assert files(build) == ["parity/tiny-qwen3/cpu-float32.json", "parity/tiny-qwen3/cpu-float32.md",
                          "parity/tiny-qwen3/cpu-float32.png"]
    assert not committed.exists()
    assert f"report: {build / 'parity/tiny-qwen3/cpu-float32.md'} (not committed" in capsys.readouterr().out


def test_parity_with_update_reports_writes_the_committed_reports(roots: Roots, one_sampling_case: None) -> None:
    """The flag reaches the sampling tests that parity runs after the goldens, too."""
    committed, build = roots
    assert main(["parity", "--model", "tiny-qwen3", "--path", "batch", "--update-reports"]) == 0
    assert files(committed) == ["parity/tiny-qwen3/cpu-float32.json", "parity/tiny-qwen3/cpu-float32.md",
                                "parity/tiny-qwen3/cpu-float32.png",
                                "sampling/cpu/sampling.json", "sampling/cpu/sampling.md"]
    assert not build.exists()


def test_parity_no_report_writes_nothing(roots: Roots) -> None:
    committed, build = roots
    assert main(["parity", "--model", "tiny-qwen3", "--path", "batch", "--no-sampling", "--no-report"]) == 0
    assert not committed.exists() and not build.exists()


@pytest.mark.parametrize("update", [False, True])
def test_sampling_writes_under_the_chosen_root(roots: Roots, one_sampling_case: None, update: bool) -> None:
    committed, build = roots
    assert main(["sampling", "--no-real"] + (["--update-reports"] if update else [])) == 0
    written, untouched = (committed, build) if update else (build, committed)
    assert files(written) == ["sampling/cpu/sampling.json", "sampling/cpu/sampling.md"]
    assert not untouched.exists()


def test_sampling_refuses_out_with_update_reports(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["sampling", "--out", str(tmp_path), "--update-reports"])


@pytest.mark.parametrize("update", [False, True])
def test_bench_writes_under_the_chosen_root(roots: Roots, update: bool) -> None:
    committed, build = roots
    text = write_bench_report(_bench_result(["m"]), update=update)
    written, untouched = (committed, build) if update else (build, committed)
    assert files(written) == [f"bench/cpu/m/{f}" for f in ("bench.csv", "bench.json", "decode.png", "decode_ctx.png",
                                                            "prefill.png", "summary.md")]
    assert not untouched.exists()
    assert str(written / "bench/cpu/m/summary.md") in text


def _bench_result(models: List[str]) -> dict:
    rows = [{"model": m, "runner": runner, "workload": workload, "batch_size": 1, "length": 8, "median_s": s,
             "tokens_per_s": 1 / s, "floor_s": 0.01, "fraction_of_floor": 0.01 / s} for m in models
            for workload in ("decode", "decode_ctx", "prefill") for runner, s in (("engine", 0.02), ("hf", 0.04))]
    return {"device": "cpu", "dtype": "float32", "rows": rows, "limits": {"bandwidth": 1e10, "matmul_flops": 1e11},
            "spec": {"offline": (4, 1, 8), "hf_offline": (2, 4)}}


def test_a_bench_of_several_models_writes_one_folder_per_model(roots: Roots) -> None:
    """One rule whatever the run's models: a model's figures are in bench/<device>/<model>/, holding its rows only,
    so a run of one model never leaves another's folder stale beside it."""
    committed, _ = roots
    write_bench_report(_bench_result(["a", "b"]), update=True)
    for model in ("a", "b"):
        csv = (committed / "bench" / "cpu" / model / "bench.csv").read_text().splitlines()
        assert len(csv) == 7 and all(line.startswith(f"{model},") for line in csv[1:])
    write_bench_report(_bench_result(["b"]), update=True)
    assert sorted(p.name for p in (committed / "bench" / "cpu").iterdir()) == ["a", "b"]


def test_a_figure_is_not_credited_to_a_commit_whose_code_it_did_not_run(tmp_path: Path) -> None:
    """provenance's git_commit: HEAD's id for a clean tree; with the code changed after HEAD (a tree copied with
    another revision's .git), a warning beside it; report or README edits do not count; no repository: unknown."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    assert report.git_commit(tmp_path) == "unknown"
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.md").write_text("a\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    assert report.git_commit(tmp_path) == head
    (tmp_path / "notes.md").write_text("b\n")
    assert report.git_commit(tmp_path) == head
    (tmp_path / "engine" / "a.py").write_text("x = 2\n")
    assert report.git_commit(tmp_path) == f"{head} with uncommitted changes to engine/ or harness/"


@pytest.mark.parametrize("folder", sorted(str(p.parent.relative_to(report.REPO_ROOT / "golden"))
                                          for p in (report.REPO_ROOT / "golden").glob("**/provenance.json")))
def test_a_report_can_be_written_from_every_committed_golden(folder: str) -> None:
    """The report's account of HF's own spread, from what each golden records (older goldens record less): the GPU
    goldens are read on the CPU here, so a report that a card would write is checked without one."""
    from harness import golden as G
    from harness.parity.gate import ParityResult, hf_largest_err, own_spread, tie_tolerance, tolerance
    from harness.parity.report import write_report

    gs = G.load(report.REPO_ROOT / "golden" / folder)
    prov = gs.provenance
    dtype, moe = prov["dtype"], "moe" in prov["model"]
    tol = tolerance(gs, dtype, moe)
    result = ParityResult(prov["model"], prov["device_type"], dtype, tol, hf_largest_err(gs, dtype, moe),
                          tie_tolerance(tol, None), own_spread(gs, dtype, moe))
    assert result.hf_stats["positions"] > 0
    assert f"parity {prov['model']}" in write_report(result, write_files=False)
