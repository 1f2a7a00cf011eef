"""python -m harness sampling: the sampler draws from the distribution the spec defines. Each case's rows (cases)
are drawn many times and held against a float64 oracle of the filtered distribution (oracle): exact checks on
every draw and a chi-square test per row with a stated power (stats); run draws, report writes what it found."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from harness import junit, report
    from harness.models import add_model_arguments
    from harness.sampling.cases import REAL_MODELS
    from harness.sampling.run import DEFAULT_MAX_COST, command

    p = sub.add_parser("sampling", help="the sampler's draws against a float64 oracle (chi-square, stated power)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, help="report folder (default build/reports/sampling/<device>)")
    report.add_update_flag(where)
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--max-cost", type=float, default=None,
                   help="cap on draws x vocab per case; binds only the cases on real logits "
                        f"(default {DEFAULT_MAX_COST['cpu']:.1e} on cpu, {DEFAULT_MAX_COST['cuda']:.1e} on cuda)")
    add_model_arguments(p, f"{', '.join(REAL_MODELS)} (the models whose real logits make cases)",
                        flag="--real-model")
    p.add_argument("--no-real", action="store_true", help="skip the cases on real logits")
    p.add_argument("--engine", default="engine", metavar="SPEC",
                   help="the engine whose sampler is tested: vllm, openai:URL or python:MODULE:CLASS draw the next "
                        "token of a prompt through the engine itself, against HF's float64 logits (docs/peers.md); "
                        "default: this engine's sampler on the grid's logits")
    p.add_argument("--draws", type=int, default=2000, help="with --engine: draws per case (default 2000)")
    p.add_argument("--case", action="append", help="with --engine: only this case (repeatable)")
    junit.add_flag(p)
    p.set_defaults(func=command)
