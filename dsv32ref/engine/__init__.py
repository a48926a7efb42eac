"""A small serving engine for DSA models: engine-form model with eager-boundary variants, forward context,
paged KV cache sized from a memory budget, breakable-graph capture, sequential requests."""

from dsv32ref.engine.engine import EngineConfig, LLMEngine, StepInput, build_model
from dsv32ref.engine.model import BOUNDARIES, COPY_BOUNDARIES, EngineModel

__all__ = ["BOUNDARIES", "COPY_BOUNDARIES", "EngineConfig", "EngineModel", "LLMEngine", "StepInput", "build_model"]
