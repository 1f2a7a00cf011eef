"""The summary of a fuzz run: what it checked, on which configurations, how fast, and the minimal failure."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from harness import report
from harness.fuzz.case import Case, Workload, describe
from harness.fuzz.search import FuzzResult
from harness.models import name_of

METHOD = """\
## What every case checks

A case is an engine configuration and a workload, both drawn by hypothesis (`harness/fuzz/strategies.py`). Its runs
(`harness/fuzz/invariants.py`):

- **reference**: each request alone on a reference engine (one slot, page_size 1, no graphs, the simple loop, the
  same dtype and kernels) in a process of its own; the workload's EOS ids are tokens these runs sample.
- **main**: the workload, free-running, in the configuration's loop. After every step (`harness/fuzz/pool.py`): no
  page held by two live requests, free and held, listed twice or leaked; every live page-table row maps to its own
  pages; every token writes its own slot and the forward changed nothing outside them and the dummy page (padding).
  A greedy or seeded request samples its reference's token wherever its logits are bitwise the reference's.
- **forced**: teacher-forced on the references' tokens; after every step every live request's K/V against the
  reference's (relative error per position, layer, K or V: 1e-4 in fp32, 0.1 in bf16); every position's
  log-probabilities within the parity tolerance of the dtype, read from the committed golden of the model (parity's
  measure and `harness.parity.gate.tolerance`; 7.5e-4 for tiny-qwen3 in fp32 on the CPU, 7.48 in bf16 on CUDA).
- **other-loop**: overlap against the simple loop: bitwise equal logits wherever both ran the same batches (up to an
  EOS stop, after which the overlap loop wastes a step), the same token wherever the logits are bitwise equal.
- **repeat**: main again, without the per-step checks (they synchronize): bitwise equal in everything.
- **eager-twin** (CUDA graphs on): main on the same engine without graphs, in a process of its own: bitwise equal.
- **process-twin** (graphs off): main on an engine of the same configuration in a process of its own, started anew
  for each configuration: bitwise equal (the same inputs give the same bits in every process).

A failure is shrunk by hypothesis to a minimal workload, then a minimal configuration, failing the same invariant in
the same run, and written as JSON; `python -m harness fuzz --replay FILE` runs that case again.
"""

CONFIG_COLUMNS = ["#", "dtype", "attention", "graphs", "slots", "page_size", "pages", "prefill budget", "overlap",
                  "cases", "seconds", "cases/min", "result"]


def _config_rows(result: FuzzResult) -> List[Dict[str, Any]]:
    rows = []
    for i, p in enumerate(result.phases, 1):
        c = p.config
        rows.append({"#": i, "dtype": c.dtype, "attention": c.attention_backend, "graphs": c.graphs,
                     "slots": c.slots, "page_size": c.page_size, "pages": c.num_pages,
                     "prefill budget": c.max_prefill_tokens, "overlap": c.overlap,
                     "invariant": c.batch_invariant, "cases": p.cases,
                     "seconds": round(p.seconds, 1), "cases/min": round(p.per_minute, 1),
                     "result": f"FAIL: {p.failure.invariant}" if p.failure else "pass"})
    return rows


def size(workload: Workload) -> str:
    r = workload.requests
    return (f"{len(r)} requests, {sum(len(x.prompt) for x in r)} prompt tokens, {sum(x.max_tokens for x in r)} "
            f"new tokens at most")


def failure_text(case: Case, path: Path | None, first: tuple | None = None) -> str:
    f = case.failure
    lines = [f"invariant {f.invariant}, in the {f.stage} run: {f.details}", f"configuration: {case.config}"]
    if first is not None:
        lines.append(f"shrunk from {size(first[1])} to {size(case.workload)}")
    lines += describe(case.workload)
    if case.reproduced:
        lines.append(f"reproduced {case.reproduced}")
    for i, past in enumerate(case.history):
        runs = f", only the runs for {past.only.invariant} in {past.only.stage}" if past.only else ""
        lines += [f"history {i} (run first on the fresh engine{runs}): " + line for line in describe(past.workload)]
    if path is not None:
        # relative to the repository, where the commands run: a committed report names no machine's paths
        path = path.relative_to(report.REPO_ROOT) if path.is_relative_to(report.REPO_ROOT) else path
        lines.append(f"case: {path}")
        named = case.model_args or f"--model {case.model}"
        lines.append(f"replay: python -m harness fuzz --device {case.device} {named} --replay {path}"
                     + (f" --plant {case.planted}" if case.planted else ""))
    return "\n".join(lines)


def summary(result: FuzzResult) -> str:
    o, c = result.options, result.counts
    search_seconds = result.seconds - result.setup_seconds - result.shrink_seconds
    cases = sum(p.cases for p in result.phases)
    rate = (f"{60.0 * cases / search_seconds:.1f} cases a minute while searching" if search_seconds >= 1.0 else
            f"{cases} cases in under a second of search (no rate)")
    totals = ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
    return "\n".join([
        f"fuzz {name_of(o.model)} on {o.device}: {'PASS' if result.passed else 'FAIL'} in {result.seconds:.0f} s "
        f"(budget {o.budget:.0f} s of search, engines built in {result.setup_seconds:.0f} s"
        + (f", shrinking {result.shrink_seconds:.0f} s" if not result.passed else "")
        + f"; seed {o.seed}" + (f"; planted fault {o.planted}" if o.planted else "") + ")",
        f"{len(result.phases)} configurations, {rate}; {totals}",
        "seconds by run: " + ", ".join(f"{k} {v:.1f}" for k, v in result.run_seconds.items()),
    ])


def markdown(result: FuzzResult, prov: Dict[str, Any]) -> str:
    parts = [f"# Scheduling fuzzer: {'PASS' if result.passed else 'FAIL'}\n", summary(result) + "\n", METHOD,
             "## Configurations\n", report.markdown_table(_config_rows(result), CONFIG_COLUMNS)]
    if result.case is not None:
        text = failure_text(result.case, result.case_path, result.first)
        parts += ["## The minimal failing case\n", "```\n" + text + "\n```\n"]
    parts += ["## Provenance\n", report.provenance_markdown(prov)]
    return "\n".join(parts)


def write(result: FuzzResult, update: bool) -> Path:
    o = result.options
    path = report.report_root(update) / "fuzz" / f"{o.device.split(':')[0]}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    prov = report.provenance(o.device, model=name_of(o.model), seed=o.seed, budget_s=o.budget, planted=o.planted)
    path.write_text(markdown(result, prov))
    return path


def table(result: FuzzResult) -> str:
    return report.text_table(_config_rows(result), CONFIG_COLUMNS)
