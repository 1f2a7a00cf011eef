"""The differential scheduling fuzzer: `python -m harness fuzz --device cpu|cuda`.

It proves, for every engine configuration and workload hypothesis draws within its budget (slots, page sizes, small
KV pools, prefill budgets, both loops, graphs, attention backends; prompts across page boundaries, cached prefixes,
EOS stops, greedy and sampled requests), what the engine promises: bitwise equality where it promises it (graphs vs
eager, overlap vs the simple loop, a run vs its repeat, a greedy or seeded request alone vs in a batch), each request's
log-probabilities and K/V within the dtype's tolerance of the request run alone, and the pool whole after every step.
A failure is shrunk to a minimal case and written as JSON for `--replay`. harness/fuzz/invariants.py lists the checks.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from harness.fuzz.cli import add_arguments

    add_arguments(sub.add_parser("fuzz", help="search configurations and workloads for broken engine invariants"))
