"""python -m harness.bench.host_profile on the CPU: every step kind gets the driver's timers, the host functions'
timers (the driver's launch once a step, inside it the engine's forward), a cProfile table that names the driver's
launch and the engine's forward (the two largest by cumulative time: the table keeps the top 60), and torch.profiler's
table; the functions are unwrapped afterwards."""

from __future__ import annotations

import json

from harness.bench.host_profile import SIZES, TIMED, main
from harness.driver import Driver


def test_host_profile_names_where_each_step_spends_its_time(tmp_path):
    assert main(["--model", "tiny-qwen3", "--device", "cpu", "--out", str(tmp_path), "--repeats", "2"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    lengths, sizes, _ = SIZES["cpu"]
    for step in [f"prefill{n}" for n in lengths] + [f"decode{b}" for b in sizes]:
        host = summary[step]["host"]
        assert host["period"] > 0 and host["launch"] > 0 and host["host_busy"] <= 1.5 * host["period"], (step, host)
        functions = summary[step]["functions"]
        assert functions["Driver._launch"]["calls_per_step"] == 1, (step, functions)
        assert 0 < functions["Engine.forward_batch"]["median_us"] <= functions["Driver._launch"]["median_us"], step
        table = (tmp_path / f"cprofile_{step}.txt").read_text()
        assert "driver.py" in table and "(_launch)" in table and "(forward_batch)" in table, step
    for step in (f"prefill{lengths[0]}", f"decode{sizes[0]}"):
        assert "aten::" in (tmp_path / f"torch_{step}.txt").read_text()
    assert all(not hasattr(getattr(Driver, m), "__wrapped__") for _, name, ms in TIMED if name == "Driver" for m in ms)
