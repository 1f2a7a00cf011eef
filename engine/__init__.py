"""The compute engine of one tensor-parallel rank: `from engine import Engine, EngineConfig`."""

from engine.config import EngineConfig
from engine.engine import Engine, ForwardOutput

__all__ = ["Engine", "EngineConfig", "ForwardOutput"]
