"""python -m harness bench: how fast the engine is, beside HF generate on the same model and workload (workloads)
and the hardware's limit measured on the same device (limits); on CUDA each decode step's profile names the bound
(profile); run measures, report writes the tables and plots; against compares this tree with another revision in
one run (ab_runner: one side's process, ab_stats: the paired ratio, its interval and the performance gate,
ab_report: its report and plot); invariance measures the default mode's batch variance and batch-invariant mode's
cost; serving replays arrival traces (arrivals) against any engine, with vLLM's serving metrics (serving_metrics),
its report (serving_report) and its gate against another revision (serving_gate); step_cost measures the cost model
the driver's step budget can follow."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from harness.models import add_model_arguments
    from harness.report import add_update_flag

    p = sub.add_parser("bench", help="throughput and latency beside HF and the hardware's limit")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_model_arguments(p, "smollm2-135m and gemma3-270m on cpu; qwen3-0.6b (dummy weights) and smollm2-135m on "
                           "cuda; a folder without weights runs on dummy weights")
    p.add_argument("--no-hf", action="store_true", help="skip the HF peers (their ratios are then missing)")
    p.add_argument("--against", metavar="REF",
                   help="instead: compare this tree with REF (a git revision or a folder holding another checkout), "
                        "both engines interleaved in this run, each row a ratio with its confidence interval "
                        "(default model: smollm2-135m on cpu, qwen3-0.6b on cuda); writes against.md")
    p.add_argument("--repeats", type=int, help="--against: paired repeats per workload and round (default: 3 cpu, "
                                               "4 cuda)")
    p.add_argument("--rounds", type=int, help="--against: rounds, each a fresh pair of processes; the interval is over "
                                              "them (default 4)")
    p.add_argument("--fail-if-slower", type=float, metavar="PCT",
                   help="--against: the performance gate; exit status 1 when a row's interval lies wholly beyond PCT "
                        "percent slower than REF (the rows are named, and against.png draws the threshold)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="instead: the default mode's batch variance (smollm2-135m, 32 prompts of real text, 64 greedy "
                        "tokens, together against alone) and batch-invariant mode's cost against the default, both "
                        "modes in this run (default model: smollm2-135m); writes batch-invariant/summary.md")
    p.add_argument("--engine", default="engine", metavar="SPEC",
                   help="instead: this engine against another (vllm, openai:URL, python:MODULE:CLASS) on the same "
                        "model and cores, interleaved, each row a ratio with its interval (default model: "
                        "smollm2-135m; --repeats: paired repeats, default 5); writes peer.md under reports/peers/")
    s = p.add_argument_group("serving (--serve)")
    s.add_argument("--serve", action="store_true",
                   help="instead: requests arriving over time, measured as `vllm bench serve` measures a server (TTFT, "
                        "TPOT, ITL, E2EL, throughput, goodput) at each point, each engine in turn; with --engine also "
                        "the other on the same traces; with --against REF the serving gate; writes serve.md "
                        "(docs/bench.md, Serving)")
    s.add_argument("--rate", action="append", metavar="R",
                   help="requests a second (inf: all at once), repeatable; default: a sweep up to saturation")
    s.add_argument("--concurrency", action="append", type=int, metavar="N",
                   help="at most N requests in flight, each sent when one finishes, repeatable")
    s.add_argument("--burstiness", type=float, default=1.0,
                   help="the arrivals' gamma shape: 1 Poisson (default), below 1 burstier")
    s.add_argument("--lengths", metavar="SPEC",
                   help="uniform:IN:OUT[:RATIO] or lognormal:IN:OUT[:SIGMA], then optionally ,long:LEN:SHARE "
                        "(default: uniform:128:32:0.5,long:1024:0.1 on cpu, uniform:1024:128:0.5,long:16384:0.05 "
                        "on cuda)")
    s.add_argument("--dataset", choices=("random", "text"), default="random",
                   help="prompts of random token ids, or excerpts of the committed real text")
    s.add_argument("--num-prompts", type=int, help="requests a trace (default: 32 cpu, 256 cuda)")
    s.add_argument("--seed", type=int, default=0, help="the first trace's seed (repeat i: seed + i)")
    s.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="the SLO goodput counts against, vLLM's: ttft:MS tpot:MS e2el:MS (any of them)")
    s.add_argument("--trace", type=Path, metavar="FILE",
                   help="replay this trace file's requests at its arrival times (docs/bench.md, Serving)")
    s.add_argument("--stall", type=float, metavar="X",
                   help="this engine's step budget: a step at most X times its decodes alone, over a cost model "
                        "measured first (default: the driver's token budget)")
    add_update_flag(p)
    p.set_defaults(func=_command)


AGAINST_ONLY = ("repeats", "rounds", "fail_if_slower")
SERVE_ONLY = ("rate", "concurrency", "lengths", "num_prompts", "goodput", "trace", "stall")


def _command(args: argparse.Namespace) -> int:
    from harness import UserError

    if args.serve:
        if args.batch_invariant:
            raise UserError("--serve and --batch-invariant are separate runs: give one of them")
        if args.against is not None and args.engine != "engine":
            raise UserError("the serving gate (--serve --against REF) runs this engine's revisions; leave --engine "
                            "out")
        stray = [f"--{k.replace('_', '-')}" for k in ("rounds", "fail_if_slower") if getattr(args, k) is not None]
        if stray and args.against is None:
            raise UserError(f"{' '.join(stray)}: only the serving gate takes it; add --against REF")
        if args.against is not None:
            from harness.bench.serving_gate import command
        else:
            from harness.bench.serving import command
        return command(args)
    serve_flags = [f"--{k.replace('_', '-')}" for k in SERVE_ONLY if getattr(args, k) is not None]
    if serve_flags:
        raise UserError(f"{' '.join(serve_flags)}: only a serving run takes it; add --serve")
    stray = [f"--{k.replace('_', '-')}" for k in AGAINST_ONLY if getattr(args, k) is not None
             and not (k == "repeats" and args.engine != "engine")]
    if args.engine != "engine" and (args.against is not None or args.batch_invariant):
        raise UserError("--engine and --against / --batch-invariant are separate runs: give one of them")
    if args.against is None and stray:
        raise UserError(f"{' '.join(stray)}: only an A/B run takes it; add --against REF (e.g. --against main)")
    if args.against is not None and args.batch_invariant:
        raise UserError("--against and --batch-invariant are separate runs: give one of them")
    if args.engine != "engine":
        from harness.bench.peer import command
    elif args.batch_invariant:
        from harness.bench.invariance import command
    elif args.against is not None:
        from harness.bench.against import command
    else:
        from harness.bench.run import command
    return command(args)
