"""The parity plot: drawn from a result as the report writer holds it, with HF's spread distribution and the gate's
limits, and without them (a report written before the golden recorded them: HF's largest error only), for every
committed report."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.parity.gate import ParityResult, PathResult, PromptResult
from harness.parity.plot import plot_errors

REPORTS = Path(__file__).resolve().parents[1] / "reports" / "parity"
PNG = b"\x89PNG\r\n\x1a\n"


def result_from_report(path: Path) -> ParityResult:
    """The ParityResult a committed JSON report was written from."""
    d = json.loads(path.read_text())
    prov = d["provenance"]
    return ParityResult(model=prov["model"], device=prov["device"], dtype=prov["dtype"], tol=d["tol"],
                        hf_spread=d["hf_spread"], hf_stats=d.get("hf_spread_stats"), tp=prov.get("tp") or 1,
                        prompts=[PromptResult(**p) for p in d["prompts"]],
                        paths=[PathResult(**p) for p in d.get("paths", [])])


@pytest.mark.parametrize("with_stats", [True, False])
@pytest.mark.parametrize("report", ["tiny-qwen3/cuda-bfloat16.json", "tiny-qwen3/cpu-float32.json"])
def test_a_plot_is_written_with_and_without_hf_stats(report: str, with_stats: bool, tmp_path: Path) -> None:
    result = result_from_report(REPORTS / report)
    assert result.hf_stats is not None
    if not with_stats:
        result = dataclasses.replace(result, hf_stats=None)
    out = plot_errors(result, tmp_path / "sub" / "plot.png")
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 10_000


def test_each_committed_parity_report_has_its_plot() -> None:
    assert [p for p in sorted(REPORTS.rglob("*.json")) if not p.with_suffix(".png").is_file()] == []
