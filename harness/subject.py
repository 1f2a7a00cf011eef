"""The engine under test (--engine): this project's, or another implementation of the spec's Engine.

`python:MODULE:CLASS` names a class that the spec's contract describes (ch06): built from an EngineConfig, with
forward_batch(batch, args) -> ForwardOutput over the spec's Req and Batch, the page table and page count the driver
fills, and shutdown(). The harness's driver runs it on every parity path exactly as it runs this project's engine,
so a reader's own implementation of the chapter, or a change to this one kept outside the tree, meets the same gate.
"""

from __future__ import annotations

import importlib
from typing import Any

from harness import UserError

OWN = "engine"  # the default: this project's engine
# checked before anything runs; what else the driver reads of an engine: docs/parity.md
REQUIRED = ("forward_batch", "shutdown")


def engine_class(spec: str = OWN) -> Any:
    """The Engine class --engine names; a name that cannot be one is refused in one line."""
    if spec == OWN:
        from engine import Engine

        return Engine
    kind, _, rest = spec.partition(":")
    module, _, name = rest.partition(":")
    if kind != "python" or not module or not name:
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


def suffix(spec: str) -> str:
    """What another engine adds to report and obtained-file names, so that it never writes this engine's."""
    return "" if spec == OWN else "-" + spec.replace(":", "-")
