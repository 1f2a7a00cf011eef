"""The report of bench --against: against.md and against.json, and against.png beside them (every row's ratio with
its interval, the threshold of --fail-if-slower drawn); the gate's rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from harness.bench.ab_stats import slower_beyond, threshold_ratio
from harness.report import markdown_table, provenance_markdown, write_json

COLUMNS = ["model", "workload", "batch_size", "length", "ref_median_s", "new_median_s", "ratio", "ci_low", "ci_high",
           "noise_pct", "rounds", "repeats", "verdict"]


def row_name(row: Dict[str, Any]) -> str:
    return row.get("name") or f"{row['model']} {row['workload']} bs {row['batch_size']} len {row['length']}"


def gate(rows: List[Dict[str, Any]], pct: float | None) -> List[Dict[str, Any]]:
    """The rows whose interval lies wholly beyond pct percent slower (none without a threshold); marks every row's
    gate column."""
    if pct is None:
        return []
    for row in rows:
        row["gate"] = "FAIL" if slower_beyond(row["ci_high"], pct) else "pass"
    return [row for row in rows if row["gate"] == "FAIL"]


def gate_text(rows: List[Dict[str, Any]], pct: float, bullet: str = "  ") -> str:
    """What the gate found: a line per failing row, naming it."""
    failed = [r for r in rows if r.get("gate") == "FAIL"]
    if not failed:
        return f"PASS: no row slower beyond {pct:g}% (every interval reaches {threshold_ratio(pct):.4f} or above)"
    return f"FAIL: {len(failed)} row(s) slower beyond {pct:g}%:\n" + "\n".join(
        f"{bullet}{row_name(r)}: ratio {r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}], at least "
        f"{100 * (1 / r['ci_high'] - 1):.1f}% slower" for r in failed)


def plot(result: Dict[str, Any], path: Path) -> Path:
    """Every row's ratio as a point with its confidence interval; 1 (no difference) and the gate's threshold drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows, pct = result["rows"], result.get("fail_if_slower_pct")
    colors = {"faster": "tab:green", "slower": "tab:orange", "no difference": "tab:gray"}
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.4 * len(rows)))
    for i, r in enumerate(rows):
        color = "tab:red" if r.get("gate") == "FAIL" else colors[r["verdict"]]
        ax.errorbar(r["ratio"], i, xerr=[[r["ratio"] - r["ci_low"]], [r["ci_high"] - r["ratio"]]], fmt="o",
                    color=color, capsize=4)
    ax.axvline(1.0, color="black", lw=1, label="1: no difference")
    if pct is not None:
        ax.axvline(threshold_ratio(pct), color="tab:red", ls="--", label=f"--fail-if-slower {pct:g}%")
    ax.set_xscale("log")  # ratios multiply: an interval exp(mean +- half) is symmetric on this axis
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_yticks(range(len(rows)), [row_name(r) for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(result.get("xlabel", "reference time / new time, with its interval (above 1: the new revision is "
                                       "faster)"))
    ax.set_title(f"This tree against {result['ref']['named']} ({result['host']['dtype']})", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(result: Dict[str, Any], out_dir: Path) -> Path:
    spec, pct = result["spec"], result.get("fail_if_slower_pct")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "against.json", result)
    plot(result, out_dir / "against.png")
    gate_md = "" if pct is None else (
        f"**Gate** (`--fail-if-slower {pct:g}`): a row fails when its whole interval lies below "
        f"{threshold_ratio(pct):.4f}, the ratio of a new revision {pct:g}% slower. "
        + gate_text(result["rows"], pct, bullet="- ") + "\n\n")
    md = (f"# This tree against {result['ref']['named']} on {result['host']['device_name']} "
          f"({result['host']['dtype']})\n\n"
          "Both revisions ran the same workloads in this one run, each engine in its own process, interleaved: "
          f"{spec['rounds']} rounds, each a fresh pair of processes (which starts first turning), of "
          f"{spec['repeats']} repeats after one warm-up; repeat i measured every side back to back, the order turning "
          "each repeat. decode: the median period of a repeat's decode steps through the driver (bs requests at "
          f"context {spec['decode_ctx']}, {spec['decode_steps']} steps); prefill: the median of a repeat's "
          f"{spec['prefill_runs']} prefill steps of one request through the driver, each the time to its first "
          "token. ratio = reference time / new time: the mean over the rounds of each round's mean log ratio, "
          f"exponentiated, with its {100 * spec['confidence']:.0f}% t-interval over the rounds (a process keeps a "
          "speed of its own for its whole life, so the rounds, not the pairs, are the independent draws): above 1 the "
          "new revision is faster. verdict: faster or slower when the whole interval lies on one side of 1, else no "
          "difference at the noise measured (noise_pct: the standard deviation of one round's mean log ratio); "
          "repeats: the pairs in all.\n\n"
          f"{gate_md}"
          f"{markdown_table(result['rows'], COLUMNS + (['gate'] if pct is not None else []))}\n"
          "![every row's ratio with its interval](against.png)\n\n"
          f"## Reference: {result['ref']['named']}\n{provenance_markdown(result['ref'])}\n"
          f"## New: this tree\n{provenance_markdown(result['new'])}\n"
          f"## Host\n{provenance_markdown(result['host'])}")
    (out_dir / "against.md").write_text(md)
    return out_dir / "against.md"
