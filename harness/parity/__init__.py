"""python -m harness parity: the engine computes what HF computes. Along every path a request can take through the
engine (paths), teacher-forced on the golden prompts, every position's log-probabilities are compared with HF's
golden file; the gate (gate) holds them to tolerances scaled by HF's own sdpa-vs-eager spread; run drives the
engine, report writes what it found."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from harness import golden as G
    from harness import junit
    from harness.models import add_model_arguments
    from harness.parity.gate import FLOOR
    from harness.parity.paths import PATHS
    from harness.parity.run import command
    from harness.report import add_update_flag

    p = sub.add_parser("parity", help="compare the engine with the golden files along every engine path")
    add_model_arguments(p, ", ".join(G.GOLDEN_MODELS), golden=True)
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="refuse a golden not made from these prompts (default: the golden's own are run)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", action="append", choices=list(FLOOR),
                   help="default: float32 on cpu; bfloat16 and float32 on cuda")
    p.add_argument("--path", action="append", choices=[p.name for p in PATHS], help="default: every path")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes; gloo on cpu, NCCL on cuda)")
    p.add_argument("--batch-invariant", action="store_true", help="the engines in batch-invariant mode "
                   "(EngineConfig.batch_invariant: a request's logits do not depend on its batch; cpu only); the "
                   "reports get a -batch-invariant suffix")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--no-report", action="store_true", help="print only; write no report files")
    add_update_flag(where)
    p.add_argument("--no-sampling", action="store_true", help="skip the sampler's distribution tests")
    p.add_argument("--engine", default="engine", metavar="SPEC",
                   help="the engine under test: python:MODULE:CLASS (a class implementing the spec's Engine, driven "
                        "on every path as this project's is), vllm (vLLM's Python API in its own virtualenv: nox -s "
                        "peer-vllm) or openai:URL (an OpenAI-compatible completions server), the last two on the "
                        "paths batch, single and free; reports under reports/peers/<engine>/, and the sampler's tests "
                        "(this project's sampler) are left to `sampling --engine`. Default: this engine "
                        "(docs/peers.md)")
    p.add_argument("--prompt", help="judge only this golden prompt (its index in the golden, or its name), run in "
                                    "the company it has on each path (the whole set), so that a failure re-runs as "
                                    "it failed; the sampler's distribution tests are then skipped")
    p.add_argument("--explain", action="store_true",
                   help="on a failure, run its prompt again with hooks on the engine's and HF's residual stream and "
                        "name the first layer (attention or MLP) where the engine departs beyond HF's own spread")
    junit.add_flag(p)
    p.set_defaults(func=command)
