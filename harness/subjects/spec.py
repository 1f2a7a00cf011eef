"""What --engine names: its kind, whether the harness drives it, the class of a driven one, where its reports go."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

from harness import UserError

if TYPE_CHECKING:
    from pathlib import Path

OWN = "engine"  # the default: this project's engine
KINDS = ("engine", "python:MODULE:CLASS", "vllm", "openai:URL")
# checked before anything runs; what else the driver reads of an engine: docs/parity.md
REQUIRED = ("forward_batch", "shutdown")


def kind(spec: str) -> str:
    """engine, python, vllm or openai; anything else is refused in one line."""
    if spec in (OWN, "vllm"):
        return spec
    head, _, rest = spec.partition(":")
    if head in ("python", "openai") and rest:
        return head
    raise UserError(f"--engine {spec}: give one of {', '.join(KINDS)} (docs/peers.md)")


def driven(spec: str) -> bool:
    """An engine the harness's driver runs (every parity path), not a black box behind an API."""
    return kind(spec) in (OWN, "python")


def engine_class(spec: str = OWN) -> Any:
    """The Engine class a driven --engine names; a name that cannot be one is refused in one line."""
    if spec == OWN:
        from engine import Engine

        return Engine
    module, _, name = spec.partition(":")[2].partition(":")
    if kind(spec) != "python" or not module or not name:
        raise UserError(f"--engine {spec}: give python:MODULE:CLASS (a class implementing the spec's Engine), or "
                        f"leave --engine out for this project's engine")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise UserError(f"--engine {spec}: cannot import {module} ({e}); put its folder on PYTHONPATH") from None
    except AttributeError:
        raise UserError(f"--engine {spec}: module {module} has no {name}") from None
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        raise UserError(f"--engine {spec}: {name} lacks {', '.join(missing)}; the spec's Engine has "
                        f"forward_batch(batch, args) -> ForwardOutput and shutdown()")
    return cls


def check(spec: str) -> None:
    """Refuse, before anything runs, an --engine that cannot be one (a black box is reached when it is opened)."""
    if driven(spec):
        engine_class(spec)
    elif kind(spec) == "openai":
        from harness.subjects.openai import check_url

        check_url(spec.partition(":")[2])


def name(spec: str) -> str:
    """The folder name of another engine's reports: reports/peers/<name>/."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in spec.replace("://", "-")).strip("-")


def report_dir(spec: str, update: bool) -> "Path":
    """Where a verb writes its reports about this engine: the report root, or reports/peers/<name>/ for another."""
    from harness.report import report_root

    root = report_root(update)
    return root if spec == OWN else root / "peers" / name(spec)


def named(spec: str, info: Dict[str, Any] | None) -> str:
    """--engine SPEC as a report names it: with the server or version its provenance (info) gives, `openai:URL (vllm
    0.32.0)`."""
    info = info or {}
    what = info.get("server") or (f"vllm {info['vllm']}" if "vllm" in info else "")
    return f"{spec} ({what})" if what else spec


def suffix(spec: str) -> str:
    """What another engine adds to obtained-file names, so that it never writes this engine's."""
    return "" if spec == OWN else "-" + name(spec)
