"""--engine python:MODULE:CLASS: another implementation of the spec's Engine through the same gate, driven on every
parity path by the harness's driver. This project's engine named that way passes every CPU path; the same class with
a fault of known size planted (layer 1's attention output 2% larger) fails, and the failure's re-run command names
the engine; a name that is not an Engine is refused in one line; its reports never take this engine's place."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import report
from harness.__main__ import main
from harness.parity.paths import PATHS
from peer_faults import PlantedOProj  # noqa: F401 (named below as python:test_engine_door:PlantedOProj)

MODEL = "tiny-qwen3"
CPU_PATHS = [p.name for p in PATHS if p.applies_to("cpu")]


class NotAnEngine:
    def shutdown(self) -> None:
        pass


def _parity(capsys: pytest.CaptureFixture, engine: str, *extra: str) -> tuple[int, str]:
    rc = main(["parity", "--model", MODEL, "--engine", engine, "--no-sampling", *extra])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_this_engine_through_the_door_passes_every_cpu_path(capsys: pytest.CaptureFixture) -> None:
    rc, out = _parity(capsys, "python:engine:Engine", "--no-report")
    assert rc == 0, out
    lines = {p: [ln for ln in out.splitlines() if f"{MODEL} cpu float32-python-engine-Engine {p} " in ln]
             for p in CPU_PATHS}
    assert all(len(ls) == 1 and "PASS" in ls[0] for ls in lines.values()), out


def test_a_planted_fault_in_a_door_engine_fails_and_its_rerun_names_it(capsys: pytest.CaptureFixture) -> None:
    rc, out = _parity(capsys, "python:test_engine_door:PlantedOProj", "--no-report", "--path", "batch")
    assert rc == 1, out
    assert "FAIL" in out and "--engine python:test_engine_door:PlantedOProj" in out, out


@pytest.mark.parametrize("spec, says", [
    ("python:engine", "give python:MODULE:CLASS"),
    ("python:no_such_module_here:Engine", "cannot import no_such_module_here"),
    ("python:engine:NoSuchClass", "module engine has no NoSuchClass"),
    ("python:test_engine_door:NotAnEngine", "NotAnEngine lacks forward_batch"),
])
def test_a_name_that_is_not_an_engine_is_refused_in_one_line(capsys: pytest.CaptureFixture, spec: str,
                                                             says: str) -> None:
    rc, out = _parity(capsys, spec, "--no-report")
    assert rc == 2 and says in out and out.strip().count("\n") == 0, out


def test_a_door_engines_report_never_takes_this_engines_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(report, "REPORTS_DIR", tmp_path / "reports")
    monkeypatch.setattr(report, "BUILD_REPORTS_DIR", tmp_path / "build")
    rc, out = _parity(capsys, "python:engine:Engine", "--path", "batch", "--update-reports")
    assert rc == 0, out
    assert not (tmp_path / "reports" / "parity").exists()
    folder = tmp_path / "reports" / "peers" / "python-engine-Engine" / "parity" / MODEL
    assert sorted(p.name for p in folder.iterdir()) == [f"cpu-float32.{e}" for e in ("json", "md", "png")]
    assert '"engine": "python:engine:Engine"' in (folder / "cpu-float32.json").read_text()
