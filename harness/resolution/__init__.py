"""The harness's own resolution: for each check (fp32 and bf16 parity per model, the component checks, the fuzzer,
the sampling grid) and each family of planted faults of size e (softmax scale x (1 + e) in decode or prefill
attention, RoPE base x (1 + e), a fraction e of KV writes sent astray, temperature x (1 + e), top-p + e, the
sampler's softmax scale), the smallest e the check detects, found by bisection in log space with the faults planted
in-process. `python -m harness resolution --device cpu|cuda` writes reports/resolution/<device>.md (under build/
unless --update-reports).
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from harness.parity.paths import PATHS
    from harness.report import add_update_flag
    from harness.resolution.faults import FAMILIES
    from harness.resolution.run import CHECKS, DEFAULT_CHECKS, DEFAULT_MODELS, DEFAULT_RATIO, cmd
    from harness.models import add_model_arguments

    p = sub.add_parser("resolution", help="the smallest planted fault each check detects (bisection over e)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--check", action="append", choices=list(CHECKS),
                   help="; ".join(f"default on {d}: {', '.join(c)}" for d, c in DEFAULT_CHECKS.items()))
    add_model_arguments(p, "; ".join(f"{', '.join(m)} on {d}" for d, m in DEFAULT_MODELS.items()) +
                        " (the models of the parity checks)", golden=True)
    p.add_argument("--family", action="append", choices=list(FAMILIES), help="default: every family")
    p.add_argument("--path", default="batch", choices=[q.name for q in PATHS],
                   help="the parity path a parity probe runs (default batch)")
    p.add_argument("--ratio", type=float, default=DEFAULT_RATIO,
                   help=f"stop when largest missed / smallest detected <= this (default {DEFAULT_RATIO})")
    p.add_argument("--fuzz-budget", type=float, default=20.0,
                   help="seconds of search a fuzz probe runs (default 20; a failure's shrinking adds up to half)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for the probes (default 1: a probe's ops are small, and one thread beats a team "
                        "that meets at every op on a shared host)")
    p.add_argument("--cells", action="store_true", help="every committed golden cell of the device (golden/ and "
                   "golden/long-context/; --model narrows them): its parity gate against the engine families, into "
                   "reports/resolution/cells.md (a run updates the rows of the cells it measured)")
    add_update_flag(p)
    p.set_defaults(func=cmd)
