"""python -m harness bench: how fast the engine is, beside HF generate on the same model and workload (workloads)
and the hardware's limit measured on the same device (limits); on CUDA each decode step's profile names the bound
(profile); run measures, report writes the tables and plots."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from harness import zoo
    from harness.bench.run import command
    from harness.report import add_update_flag

    p = sub.add_parser("bench", help="throughput and latency beside HF and the hardware's limit")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--model", action="append", choices=list(zoo.MODELS),
                   help="default: smollm2-135m and gemma3-270m on cpu; qwen3-0.6b (dummy weights) and smollm2-135m "
                        "on cuda")
    p.add_argument("--no-hf", action="store_true", help="skip the HF peers (their ratios are then missing)")
    add_update_flag(p)
    p.set_defaults(func=command)
