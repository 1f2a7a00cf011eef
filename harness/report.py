"""Report writing shared by parity, sampling and bench: where reports go, provenance, markdown tables, JSON,
terminal tables."""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
REPORTS_DIR = REPO_ROOT / "reports"  # committed: rewritten only on request (--update-reports)
BUILD_REPORTS_DIR = REPO_ROOT / "build" / "reports"  # git-ignored: where a plain run writes
UPDATE_FLAG = "--update-reports"


def report_root(update: bool) -> Path:
    """The folder a verb writes its reports under, in the same layout either way: the committed reports/ only when
    asked, else build/reports/, so that a plain run leaves the working tree clean."""
    return REPORTS_DIR if update else BUILD_REPORTS_DIR


def add_update_flag(parser: "argparse._ActionsContainer") -> None:
    parser.add_argument(UPDATE_FLAG, dest="update_reports", action="store_true",
                        help="write the committed reports under reports/ (default: build/reports/, git-ignored)")


def written_to(path: Path, update: bool) -> str:
    """The line a verb prints after writing a report: where it went and, for a scratch copy, how to commit one."""
    if update:
        return f"report: {path} (committed reports updated)"
    return f"report: {path} (not committed; {UPDATE_FLAG} writes it under {REPORTS_DIR}/)"


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or _cpu_model() or platform.machine()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def git_commit(root: Path = REPO_ROOT) -> str:
    """HEAD's short id, and a warning when the code (engine/, harness/) differs from it: a tree copied to another
    machine may carry a .git of another revision, and a figure must not be credited to a commit whose code it did
    not run (source_sha256 names the code either way)."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return "unknown"
        changed = git("status", "--porcelain", "--", "engine", "harness")
        return f"{head} with uncommitted changes to engine/ or harness/" if changed else head
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def source_sha256() -> str:
    """A digest of the code that made a figure (engine/ and harness/ sources, the CUDA source nvcc builds and the
    skinny GEMM's table): checkable on any checkout, where a commit id alone can be stale (a tree copied to a GPU
    machine without its .git)."""
    root = Path(__file__).resolve().parent.parent
    files = sorted([*root.glob("engine/**/*.py"), *root.glob("harness/**/*.py"), *root.glob("engine/**/*.json"),
                    *root.glob("engine/**/*.cu")])
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def _command() -> str:
    prog = Path(sys.argv[0])
    head = ["python", "-m", prog.parent.name] if prog.name == "__main__.py" else [prog.name]
    return " ".join(shlex.quote(a) for a in [*head, *sys.argv[1:]])


def provenance(device: str, **extra: Any) -> Dict[str, Any]:
    """Where a figure came from: command, machine, versions, time."""
    import torch
    import transformers

    prov = {
        "command": _command(),
        "device": device,
        "device_name": device_name(device),
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "source_sha256": source_sha256(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if device == "cpu":
        from engine.utils.threads import mkl_cnr_mode

        prov["mkl_cnr"] = mkl_cnr_mode()  # MKL's reproducibility mode: bits the same in every process when on
    try:
        import flashinfer

        prov["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    prov.update(extra)
    return prov


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0.0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: Sequence[Dict[str, Any]], columns: List[str] | None = None) -> str:
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def text_table(rows: Sequence[Dict[str, Any]], columns: List[str] | None = None) -> str:
    """A fixed-width table for the terminal."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    out = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def provenance_markdown(prov: Dict[str, Any]) -> str:
    return "\n".join(f"- {k}: `{v}`" for k, v in prov.items()) + "\n"


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
