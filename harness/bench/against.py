"""python -m harness bench --against REF: what a change costs, measured in one run against another revision.

REF is a git revision (checked out into a temporary worktree, removed afterwards) or a folder holding another
checkout. Each side runs in its own process (harness/bench/ab_runner.py of this tree, with PYTHONPATH at the side's
tree: one engine per process, the other revision's own engine and driver). Both run the same workloads, interleaved:
repeat i measures every side back to back, the order turning each repeat (A B, B A, ...), so drift of the host hits
both. A run is several rounds, each with a fresh pair of processes (which starts first turning too), because a
process keeps a speed of its own for its whole life (ab_stats). Each row: the medians, the ratio reference / new with
its confidence interval over the rounds (ab_stats.rounds_ratio), and a verdict; with --fail-if-slower PCT, the gate:
exit status 1 when a row's interval lies wholly beyond PCT percent slower (ab_stats.slower_beyond). Writes
<reports>/bench/<device>/against.{md,json,png} (ab_report).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Sequence, Tuple

from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, progress
from harness.bench import ab_report
from harness.bench.ab_stats import rounds_ratio
from harness.report import REPO_ROOT, provenance, text_table

if TYPE_CHECKING:
    from harness.models import ModelRef

RUNNER = Path(__file__).with_name("ab_runner.py")
# run the runner by path without putting its folder first on sys.path (its siblings would shadow modules)
BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
DEFAULT_MODELS = {"cpu": ["smollm2-135m"], "cuda": ["qwen3-0.6b"]}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


@dataclass(frozen=True)
class AgainstSpec:
    decode_bs: Tuple[int, ...]
    decode_ctx: int
    decode_steps: int  # decode steps per repeat; a repeat's sample is their median
    prefill_lengths: Tuple[int, ...]
    repeats: int  # paired repeats per round
    rounds: int = 4  # fresh pairs of processes; the interval is over the rounds
    prefill_runs: int = 3  # prefills per repeat; a repeat's sample is their median
    confidence: float = 0.95

    def workloads(self) -> List[Dict[str, Any]]:
        return ([{"workload": "decode", "bs": b, "ctx": self.decode_ctx, "steps": self.decode_steps}
                 for b in self.decode_bs] +
                [{"workload": "prefill", "length": n, "runs": self.prefill_runs} for n in self.prefill_lengths])


SPECS = {"cpu": AgainstSpec((1, 8), 128, 8, (128, 512), 3), "cuda": AgainstSpec((1, 64, 256), 512, 32, (128, 512), 4)}


# ------------------------------------------------------------------------------------------------ the revisions
def _git(tree: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def tree_provenance(tree: Path, named: str, where: str = "the folder given") -> Dict[str, Any]:
    """What a side ran: the tree's commit when it is a git checkout of its own (a folder inside another checkout,
    say an exported revision, would otherwise read the enclosing checkout's HEAD); where: the tree in words, not its
    path (a report is committed, and a machine's paths mean nothing elsewhere)."""
    top = _git(tree, "rev-parse", "--show-toplevel")
    commit = _git(tree, "rev-parse", "HEAD") if top and Path(top).resolve() == tree.resolve() else ""
    return {"named": named, "tree": where, "commit": commit or "not a git checkout",
            "subject": _git(tree, "log", "-1", "--format=%s") if commit else "",
            "uncommitted_changes": bool(_git(tree, "status", "--porcelain")) if commit else "unknown"}


@contextmanager
def checkout(ref: str, repo: Path = REPO_ROOT) -> Iterator[Tuple[Path, Dict[str, Any]]]:
    """(tree, provenance) of REF: a folder as it is, or a git revision of repo in a temporary worktree."""
    folder = Path(ref)
    if folder.is_dir():
        if not (folder / "engine" / "__init__.py").is_file():
            raise UserError(f"--against {ref}: the folder holds no checkout of this project (no engine/__init__.py); "
                            "give a folder holding one, or a git revision")
        yield folder.resolve(), tree_provenance(folder.resolve(), ref)
        return
    commit = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if not commit:
        raise UserError(f"--against {ref}: neither a folder nor a git revision of {repo}; give a branch, a tag, a "
                        "commit or a path to another checkout")
    tmp = Path(tempfile.mkdtemp(prefix="bench-against-"))
    try:
        out = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tmp / "tree"), commit],
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"git worktree add {commit} failed: {out.stderr.strip()}")
        yield tmp / "tree", tree_provenance(tmp / "tree", ref, f"a temporary worktree of {commit[:7]}")
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tmp / "tree")],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the sides
def side_path(tree: Path, inherited: str | None = None) -> str:
    """PYTHONPATH for a side: its tree first, then the inherited entries (where packages may live, e.g. kernels
    installed to a folder) less any checkout of this project, whose engine would stand in for a module the tree
    lacks."""
    inherited = os.environ.get("PYTHONPATH", "") if inherited is None else inherited
    rest = [p for p in inherited.split(os.pathsep) if p and not (Path(p) / "engine" / "__init__.py").is_file()]
    return os.pathsep.join([str(tree), *rest])


class Side:
    """One runner process over one tree."""

    def __init__(self, name: str, tree: Path, env: Dict[str, str] | None = None) -> None:
        self.name, self.tree = name, tree
        self.log = tempfile.TemporaryFile(mode="w+")  # its stderr, shown when it fails
        self.proc = subprocess.Popen([sys.executable, "-c", BOOT, str(RUNNER)], cwd=tree, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env={**os.environ, "PYTHONPATH": side_path(tree), **(env or {})})

    def send(self, request: Dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> Dict[str, Any]:
        line = self.proc.stdout.readline()
        answer = json.loads(line) if line else {"error": "the runner exited"}
        if "error" in answer:
            self.log.seek(0)
            raise RuntimeError(f"{self.name} side ({self.tree}) failed:\n{answer['error']}\n"
                               f"its stderr ends:\n{self.log.read()[-4000:]}")
        return answer

    def measure(self, workload: Dict[str, Any]) -> float:
        self.send({"op": "measure", **workload})
        return float(self.receive()["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def _setup(model: ModelRef | str, device: str, spec: AgainstSpec) -> Dict[str, Any]:
    from harness.models import as_model

    model = as_model(model)
    seq = max([spec.decode_ctx + spec.decode_steps + 8, *spec.prefill_lengths]) + 64
    return {"model_path": str(model.folder), "dummy_weights": not model.has_weights,
            "device": device, "dtype": DTYPES[device.split(":")[0]], "max_running_req": max(spec.decode_bs),
            "max_seq_len": seq, "num_pages": max(spec.decode_bs) * seq + seq}


def measure(sides: Sequence[Side], setup: Dict[str, Any], spec: AgainstSpec) -> Dict[str, List[List[float]]]:
    """Per side, per workload, the repeats' seconds. The sides start together (their imports overlap); each
    workload is warmed up once on every side, then repeat i runs it on every side back to back, rotating the
    order."""
    for side in sides:
        side.send(setup)
    ready = {side.name: side.receive() for side in sides}
    for side in sides:
        if not Path(ready[side.name]["engine_file"]).resolve().is_relative_to(side.tree.resolve()):
            raise RuntimeError(f"{side.name} side imported its engine from {ready[side.name]['engine_file']}, not "
                               f"from {side.tree}: is an installed copy shadowing PYTHONPATH?")
    samples: Dict[str, List[List[float]]] = {side.name: [] for side in sides}
    for workload in spec.workloads():
        for side in sides:
            side.measure(workload)
            samples[side.name].append([])
        for i in range(spec.repeats):
            k = i % len(sides)
            for side in list(sides[k:]) + list(sides[:k]):
                samples[side.name][-1].append(side.measure(workload))
    return samples


def measure_rounds(make_sides: Callable[[int], List[Side]], setup: Dict[str, Any], spec: AgainstSpec,
                   on_round: Callable[[int], None] | None = None) -> List[Dict[str, List[List[float]]]]:
    """measure() once per round, each round on the fresh sides make_sides(round) starts (closed after it);
    on_round(round) as each ends."""
    rounds = []
    for r in range(spec.rounds):
        with ExitStack() as stack:
            sides = make_sides(r)
            for side in sides:
                stack.callback(side.close)
            rounds.append(measure(sides, setup, spec))
        if on_round is not None:
            on_round(r)
    return rounds


def compare_rows(model: str, spec: AgainstSpec, rounds: List[Dict[str, List[List[float]]]], ref: str,
                 new: str) -> List[Dict[str, Any]]:
    """One row per workload from the rounds' samples (measure's output, one per round)."""
    import statistics

    rows = []
    for w, workload in enumerate(spec.workloads()):
        ref_r, new_r = [rnd[ref][w] for rnd in rounds], [rnd[new][w] for rnd in rounds]
        stat = rounds_ratio(ref_r, new_r, spec.confidence)
        ref_all, new_all = [x for r in ref_r for x in r], [x for r in new_r for x in r]
        rows.append({"model": model, "workload": workload["workload"], "batch_size": workload.get("bs", 1),
                     "length": workload.get("ctx", workload.get("length")),
                     "ref_median_s": statistics.median(ref_all), "new_median_s": statistics.median(new_all),
                     "ratio": stat.ratio, "ci_low": stat.low, "ci_high": stat.high,
                     "noise_pct": 100 * stat.noise, "rounds": len(rounds), "repeats": len(ref_all),
                     "verdict": stat.verdict, "ref_samples": ref_r, "new_samples": new_r})
    return rows


def run_against(ref: str, device: str, models: List[ModelRef | str], spec: AgainstSpec, out_dir: Path,
                fail_if_slower: float | None = None) -> Dict[str, Any]:
    """Compare this tree ("new") with REF ("ref") on each model; writes against.md, against.json and against.png into
    out_dir. fail_if_slower: the gate's threshold in percent (ab_report.gate marks the rows beyond it)."""
    from harness.models import as_model

    rows: List[Dict[str, Any]] = []
    clock = progress.Stopwatch()
    with checkout(ref) as (ref_tree, ref_prov):
        for model_ref in map(as_model, models):
            setup, model = _setup(model_ref, device, spec), model_ref.name
            trees = [("ref", ref_tree), ("new", REPO_ROOT)]

            def sides(r: int) -> List[Side]:
                return [Side(name, tree) for name, tree in (trees if r % 2 == 0 else trees[::-1])]

            def round_done(r: int) -> None:
                progress.line("bench", f"--against {ref} {model} round {r + 1}/{spec.rounds}", "done", clock.lap())
            rows += compare_rows(model, spec, measure_rounds(sides, setup, spec, round_done), "ref", "new")
    ab_report.gate(rows, fail_if_slower)
    result = {"device": device, "spec": asdict(spec), "fail_if_slower_pct": fail_if_slower, "rows": rows,
              "ref": ref_prov, "new": tree_provenance(REPO_ROOT, "this tree", "this checkout"),
              "host": provenance(device, dtype=DTYPES[device.split(":")[0]])}
    ab_report.write(result, out_dir)
    return result


def _spec(args: Any, device: str) -> AgainstSpec:
    """The device's spec with the command's --repeats and --rounds; what cannot measure anything is refused."""
    spec = SPECS[device]
    if args.repeats is not None:
        if args.repeats < 1:
            raise UserError(f"--repeats {args.repeats} measures nothing; give 1 or more paired repeats per round")
        spec = AgainstSpec(**{**asdict(spec), "repeats": args.repeats})
    if args.rounds is not None:
        if args.rounds < 2:
            raise UserError(f"--rounds {args.rounds}: the interval is over the rounds (one pair of processes cannot "
                            "tell its own bias from a difference); give --rounds 2 or more")
        spec = AgainstSpec(**{**asdict(spec), "rounds": args.rounds})
    return spec


def command(args: Any) -> int:
    from harness.report import report_root, written_to

    check_device(args.device, flashinfer=args.device.startswith("cuda"))  # both sides' engines run FlashInfer's
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    spec = _spec(args, device)
    if args.fail_if_slower is not None and not args.fail_if_slower >= 0:
        raise UserError(f"--fail-if-slower {args.fail_if_slower:g} is not a percentage of 0 or more; give the percent "
                        "slower a row may be (e.g. 5)")
    out_dir = report_root(args.update_reports) / "bench" / device
    from harness.models import resolve_models

    models = resolve_models(args, DEFAULT_MODELS[device], weights=False, tokenizer=False, verb="bench")
    result = run_against(args.against, args.device, models, spec, out_dir, args.fail_if_slower)
    pct = args.fail_if_slower
    print(text_table(result["rows"], ab_report.COLUMNS + (["gate"] if pct is not None else [])))
    print(written_to(out_dir / "against.md", args.update_reports))
    if pct is None:
        return EXIT_PASS
    print(ab_report.gate_text(result["rows"], pct))
    return EXIT_FINDING if any(r["gate"] == "FAIL" for r in result["rows"]) else EXIT_PASS
