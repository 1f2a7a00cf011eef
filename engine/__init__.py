"""The compute engine of one tensor-parallel rank: `from engine import Engine, EngineConfig`."""

import os

from engine.utils.threads import MKL_CNR

# MKL reads its reproducibility mode when it first computes, so before anything in this process can have used it:
# bitwise the same GEMMs in every process (engine.utils.threads, docs/parity-determinism.md)
os.environ.setdefault("MKL_CBWR", MKL_CNR)

from engine.config import EngineConfig  # noqa: E402 (after the environment MKL reads)
from engine.engine import Engine, ForwardOutput  # noqa: E402

__all__ = ["Engine", "EngineConfig", "ForwardOutput"]
