"""A parity run's error distribution beside HF's own spread, as a picture: per path the engine's per-position error
quantiles (|log-probability difference| at p50, p90, p99 and the largest) and KL (mean, p99), HF against itself
(eager vs sdpa: what two correct implementations differ by) and the limits the gate holds them to."""

from __future__ import annotations

from pathlib import Path

from harness.parity.gate import ParityResult

ERR_QUANTILES = ("err_p50", "err_p90", "err_p99", "err_max")
KL_STATS = ("kl_mean", "kl_p99")
TINY = 1e-12  # a log axis cannot show 0: exact agreement is drawn at this height


def plot_errors(result: ParityResult, path: Path) -> Path:
    """Write the PNG to path: errors (left) and KL (right) on log axes, a line per engine path, HF's spread in black,
    the tolerance and the half-precision gate's limits dashed in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (err_ax, kl_ax) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    hf = result.hf_stats or {}
    for p in result.paths:
        if not p.stats:
            continue
        err_ax.plot(range(len(ERR_QUANTILES)), [max(p.stats[q], TINY) for q in ERR_QUANTILES], marker="o", lw=1,
                    alpha=0.8, label=p.path)
        kl_ax.plot(range(len(KL_STATS)), [max(p.stats[k], TINY) for k in KL_STATS], marker="o", lw=1, alpha=0.8)
    if not result.paths:  # reports from before the distributions were kept: each path's largest error only
        for name in dict.fromkeys(p.path for p in result.prompts):
            worst = max(max(p.max_err_prefill, p.max_err_decode) for p in result.prompts if p.path == name)
            err_ax.plot([len(ERR_QUANTILES) - 1], [max(worst, TINY)], marker="o", ls="none", label=name)
    if hf:
        err_ax.plot(range(len(ERR_QUANTILES)), [max(hf[q], TINY) for q in ERR_QUANTILES], color="black", lw=3,
                    marker="s", label="HF's own spread (its kernels, or to float64)")
        kl_ax.plot(range(len(KL_STATS)), [max(hf[k], TINY) for k in KL_STATS], color="black", lw=3, marker="s")
    else:  # older goldens and fp32 ones record HF's largest error only
        err_ax.plot([len(ERR_QUANTILES) - 1], [max(result.hf_spread, TINY)], color="black", marker="s", ms=9,
                    ls="none", label="HF's spread, largest (eager vs sdpa)")
    err_ax.axhline(result.tol, color="red", ls="--", lw=1, label=f"tolerance {result.tol:.3g}")
    limits = next((p.limits for p in result.paths if p.limits), None)
    if limits:
        err_ax.plot([ERR_QUANTILES.index("err_p99")], [limits["err_p99"]], color="red", marker="_", ms=30, mew=2,
                    ls="none", label="the gate's limits")
        kl_ax.plot(range(len(KL_STATS)), [limits[k] for k in KL_STATS], color="red", marker="_", ms=30, mew=2,
                   ls="none")
    for ax, names, title in ((err_ax, ERR_QUANTILES, "|log-prob difference| per position"),
                             (kl_ax, KL_STATS, "KL per position")):
        ax.set_xticks(range(len(names)), [n.split("_", 1)[1] for n in names])
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    err_ax.legend(fontsize=7, ncol=2)
    tp = f", TP={result.tp}" if result.tp > 1 else ""
    fig.suptitle(f"parity {result.model}, {result.device}{tp}, {result.dtype}: {'PASS' if result.passed else 'FAIL'}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
