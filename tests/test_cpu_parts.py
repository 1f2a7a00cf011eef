"""python -m harness.bench.cpu_parts: a CPU step's time by part of the engine. The parts of a step add up to its time
(exclusive times: the activation inside the down projection's linear is counted once), the GEMMs, attention and the
driver are found in every step, and the wrappers are gone afterwards."""

from __future__ import annotations

import time

import pytest

from harness.bench.cpu_parts import cpu_parts, main, part_timers, table


@pytest.mark.parametrize("threads", [1, None])
def test_every_step_is_the_sum_of_its_parts(tmp_path, threads):
    summary = cpu_parts("tiny-qwen3", tmp_path, repeats=1, threads=threads, prefills=(24,), decode_bs=(3,))
    assert summary["clock"] == ("thread_time" if threads == 1 else "perf_counter")
    for step in ("prefill24", "decode3"):
        ms = summary[step]["ms"]
        parts = {k: v for k, v in ms.items() if k not in ("step", "period (wall, median)")}
        assert ms["step"] == pytest.approx(sum(parts.values()))
        assert all(v >= 0 for v in parts.values()), ms
        assert ms["gemm"] > 0 and ms["attention"] > 0 and ms["driver"] > 0 and ms["lm head"] > 0, ms
        assert "aten::" in (tmp_path / f"torch_{step}.txt").read_text()
    assert "| gemm |" in table(summary)


def test_a_part_inside_another_is_counted_once():
    class Ops:
        def inner(self):
            time.sleep(0.02)

        def outer(self):
            self.inner()
            time.sleep(0.01)

    class Engine:
        def forward_batch(self):
            self.model.ops.outer()

    engine = Engine()
    engine.model = type("Model", (), {})()
    engine.model.ops = Ops()
    parts = {"outer": ("engine.model.ops", ("outer",)), "inner": ("engine.model.ops", ("inner",)),
             "forward_batch": ("engine", ("forward_batch",))}
    with part_timers({"engine": engine}, parts) as forwards:
        engine.forward_batch()
    (step,) = forwards
    assert 0.02 <= step["inner"] < 0.03 and 0.01 <= step["outer"] < 0.02, step
    assert step["forward_batch"] == pytest.approx(sum(v for k, v in step.items() if k != "forward_batch"))
    assert "outer" not in vars(engine.model.ops) and "forward_batch" not in vars(engine)


def test_cli_prints_the_table(tmp_path, capsys, monkeypatch):
    import harness.bench.cpu_parts as cp

    monkeypatch.setattr(cp, "PREFILLS", (16,))
    monkeypatch.setattr(cp, "DECODE_BS", (2,))
    assert main(["--model", "tiny-qwen3", "--out", str(tmp_path), "--repeats", "1"]) == 0
    assert "| ms a step | prefill16 | decode2 |" in capsys.readouterr().out
