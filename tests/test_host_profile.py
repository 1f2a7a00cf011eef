"""python -m harness.bench.host_profile on the CPU: every step kind gets the driver's timers, the host functions'
timers (the driver's launch once a step, inside it the engine's forward; a step's time of a caller at least its
callees', as sums must be and a median a call of a function whose calls differ need not be), a cProfile table that
names the driver's launch and the engine's forward (the two largest by cumulative time: the table keeps the top 60),
and torch.profiler's table; the functions are unwrapped afterwards."""

from __future__ import annotations

import json

from harness.bench.host_profile import SIZES, TIMED, main
from harness.driver import Driver

# (caller, callee) among the timed functions: every call of the callee happens inside one of the caller
NESTED = [("Driver._schedule", "Driver._admit"), ("Driver._schedule", "Driver._make_step"),
          ("Driver._schedule", "Driver._release"), ("Driver._launch", "Driver._prefill_inputs"),
          ("Driver._launch", "Driver._decode_inputs"), ("Driver._launch", "Engine.forward_batch"),
          ("Driver._launch", "Driver._feed_back"), ("Driver._launch", "Sampler.prepare"),
          ("Engine.forward_batch", "Sampler.sample"), ("Driver._release", "PageAllocator.free")]


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
        for caller, callee in NESTED:
            if callee in functions:
                assert functions[callee]["us_per_step"] <= functions[caller]["us_per_step"], (step, caller, callee)
        table = (tmp_path / f"cprofile_{step}.txt").read_text()
        assert "driver.py" in table and "(_launch)" in table and "(forward_batch)" in table, step
    for step in (f"prefill{lengths[0]}", f"decode{sizes[0]}"):
        assert "aten::" in (tmp_path / f"torch_{step}.txt").read_text()
    assert all(not hasattr(getattr(Driver, m), "__wrapped__") for _, name, ms in TIMED if name == "Driver" for m in ms)
