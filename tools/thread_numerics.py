"""Which op's bits follow the CPU thread count or the machine's load: tiny-qwen3's parity batch path, op by op.

    python tools/thread_numerics.py                  # 1, 2 and all cores' threads, each against the engine's own
    python tools/thread_numerics.py --threads 1 3 --call 1 --busy   # the first decode step, with the cores busy

Each setting runs in a process of its own (the environment, e.g. OMP_DYNAMIC=TRUE, is read when torch loads: --env).
Every aten op of the chosen forward call (0: the prefill of all nine prompts, 1: the first decode step) is recorded
under a TorchDispatchMode as a bit fingerprint of its output, whole and per row; every call's logits the same way.
The report lists the ops whose inputs are bitwise the same as the reference's but whose output is not (where a
difference starts), with the prompt and position of each differing row. docs/parity-determinism.md has the results.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _weights(n: int) -> torch.Tensor:
    return torch.randint(1, 2 ** 31 - 1, (n,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)


def fingerprint(t: Any) -> Dict[str, Any] | None:
    """float32 bits, summed with fixed random weights: per row of dim 0 (per (batch, query) of a 4-D attention
    tensor) and whole. Equal bits give equal fingerprints; a one-bit change changes them."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() == 0:
        return None
    x = t.detach().contiguous().view(torch.int32).to(torch.int64)
    rows = x.permute(0, 2, 1, 3) if x.dim() == 4 else x
    rows = rows.reshape(rows.shape[0] * (rows.shape[1] if x.dim() == 4 else 1), -1) if x.dim() else rows.reshape(1, 1)
    per_row = (rows * _weights(rows.shape[1])).sum(1)
    return {"shape": list(t.shape), "all": int(per_row.sum()), "rows": per_row}


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        outs = [fingerprint(o) for o in tree_flatten(out)[0]]
        if any(outs):
            ins = [f["all"] if f else None for f in map(fingerprint, tree_flatten((args, kwargs))[0])]
            self.ops.append({"op": str(func), "in": ins, "out": outs})
        return out


def child(dest: str, threads: int | None, call: int) -> None:
    """One run of the batch path at `threads` (None: the engine's own count), recorded into dest."""
    from harness import golden as G
    from harness.parity.paths import PATHS
    from harness.parity.run import drive_path, path_engine, plan_path

    gs = G.load_checked("tiny-qwen3", "cpu", "float32")
    plan = plan_path(next(p for p in PATHS if p.name == "batch"), "cpu", "float32", gs)
    engine = path_engine(plan, "tiny-qwen3")
    if threads:
        torch.set_num_threads(threads)
    rec, calls, forward = Recorder(), [], engine.model.forward

    def traced(*a: Any, **k: Any) -> torch.Tensor:
        if len(calls) == call:
            with rec:
                out = forward(*a, **k)
        else:
            out = forward(*a, **k)
        calls.append(fingerprint(out))
        return out

    engine.model.forward = traced
    try:
        drive_path(engine, plan, gs)
    finally:
        engine.shutdown()
    torch.save({"ops": rec.ops, "calls": calls, "names": [p.name for p in gs.prompts], "call": call,
                "lens": [len(p.prompt_ids) for p in gs.prompts], "threads": torch.get_num_threads()}, dest)


def compare(ref: Dict[str, Any], other: Dict[str, Any]) -> List[str]:
    """Where other's bits depart from ref's: the ops that start a difference, then the logits of every call."""
    starts = [0] + list(itertools.accumulate(ref["lens"] if ref["call"] == 0 else [1] * len(ref["lens"])))

    def where(row: int) -> str:
        i = next(i for i in range(len(starts) - 1) if starts[i] <= row < starts[i + 1])
        return f"{ref['names'][i]}@{row - starts[i]}" if ref["call"] == 0 else f"decode row {row}"

    lines = []
    for i, (a, b) in enumerate(zip(ref["ops"], other["ops"])):
        for fa, fb in zip(a["out"], b["out"]):
            if fa and fa["all"] != fb["all"] and a["in"] == b["in"]:
                bad = (fa["rows"] != fb["rows"]).nonzero().flatten().tolist()
                rows = ", ".join(where(r) for r in bad[:4]) if len(fa["shape"]) in (2, 3) else f"{len(bad)} rows"
                lines.append(f"  op {i} {a['op']} {fa['shape']}: same inputs, {len(bad)} rows differ ({rows})")
    for i, (a, b) in enumerate(zip(ref["calls"], other["calls"])):
        if a["all"] != b["all"]:
            bad = (a["rows"] != b["rows"]).nonzero().flatten().tolist()
            lines.append(f"  call {i} logits {a['shape']}: rows {bad[:12]} differ")
    return lines or ["  bitwise the same"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="*", default=sorted({1, 2, os.cpu_count() or 1}))
    ap.add_argument("--call", type=int, default=0, help="the forward call traced op by op (0: prefill)")
    ap.add_argument("--env", nargs="*", default=[], help="KEY=VALUE for every setting's process, e.g. OMP_DYNAMIC=TRUE")
    ap.add_argument("--busy", action="store_true", help="also the engine's own count with every core busy")
    ap.add_argument("--child", nargs=2, metavar=("DEST", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]) or None, args.call)
    sys.path.insert(0, str(ROOT / "tests"))
    from test_load_stability import busy_cores

    env = dict(os.environ, PYTHONPATH=str(ROOT), **dict(kv.split("=", 1) for kv in args.env))
    with tempfile.TemporaryDirectory() as tmp:
        def run(name: str, threads: int) -> Dict[str, Any]:
            dest = f"{tmp}/{name}.pt"
            subprocess.run([sys.executable, __file__, "--call", str(args.call), "--child", dest, str(threads)],
                           env=env, check=True)
            return torch.load(dest, weights_only=False)

        ref = run("ref", 0)
        print(f"reference: the engine's own count ({ref['threads']} threads), forward call {args.call}, "
              f"{len(ref['ops'])} ops")
        for t in args.threads:
            print(f"{t} threads:", *compare(ref, run(f"t{t}", t)), sep="\n")
        if args.busy:
            with busy_cores():
                print("every core busy:", *compare(ref, run("busy", 0)), sep="\n")


if __name__ == "__main__":
    main()
