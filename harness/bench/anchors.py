"""Published figures for this model class on other GPUs, beside this run's: labelled as published, with their setups.

They were not measured here: other machines, other software, other definitions of a step. They place this run's
batch-1 decode among the numbers people quote, and the megakernels show how near the bandwidth floor a decode step
can get.
"""

from __future__ import annotations

from typing import Any, Dict, List

from harness.report import markdown_table

PUBLISHED: List[Dict[str, Any]] = [
    {"system": "vLLM", "model": "Qwen3-0.6B", "hardware": "H100", "setup": "time per output token (TPOT)",
     "published": "2.39 ms a token", "beside": "step"},
    {"system": "SGLang", "model": "Qwen3-0.6B", "hardware": "H20", "setup": "decode throughput at batch 1",
     "published": "414 tok/s (2.42 ms a token)", "beside": "step"},
    {"system": "a megakernel", "model": "Llama-3.2-1B", "hardware": "H100", "setup": "one decode forward at batch 1",
     "published": "under 1 ms, 78% of the bandwidth", "beside": "replay"},
    {"system": "a megakernel", "model": "Qwen3-0.6B", "hardware": "RTX 5090", "setup": "one decode forward at batch 1",
     "published": "0.99 ms, 71% of its bandwidth", "beside": "replay"},
]
MODEL = "qwen3-0.6b"  # the engine's model of that class in this run


def anchors_section(result: Dict[str, Any]) -> str:
    rows, profiles = result["rows"], result.get("profiles", [])
    step = next((r for r in rows if r["model"] == MODEL and r["runner"] == "engine" and r["workload"] == "decode"
                 and r["batch_size"] == 1), None)
    replay = next((p for p in profiles if p["model"] == MODEL and p["runner"] == "engine" and p["batch_size"] == 1
                   and "replay_s" in p), None)
    if step is None:
        return ""
    ours = {"step": f"decode step through the driver {step['median_s'] * 1e3:.2f} ms "
                    f"({1 / step['median_s']:,.0f} tok/s)"}
    if replay is not None:
        ours["replay"] = (f"graph replay {replay['replay_s'] * 1e3:.2f} ms, "
                          f"{100 * step['floor_s'] / replay['replay_s']:.0f}% of the bandwidth floor")
    table = [{**{k: a[k] for k in ("system", "model", "hardware", "setup", "published")},
              "this run (qwen3-0.6b shape, dummy weights)": ours.get(a["beside"], "-")} for a in PUBLISHED]
    return ("## Published figures beside this run's\n"
            "Published for this model class on other GPUs, not measured here (other machines, software and "
            f"definitions of a step); this run's figure beside each (context {result['spec']['decode_ctx']}):\n\n"
            f"{markdown_table(table)}\n")
