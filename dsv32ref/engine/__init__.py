"""A small serving engine for DSA models, one file per job:

    boundary       what each eager boundary keeps eager, who owns the attention output, its static buffers
    model          the engine-form model (fused projections, Triton kernels) for one boundary
    weights        reference weights into the engine layout, tensor-parallel shards, dummy weights
    context        the per-step forward context the eager regions read
    config         EngineConfig
    input_batch    a step's inputs: static device buffers and their pinned staging
    memory         start-up memory planning: profile run, graph-memory estimate, KV-cache size
    model_runner   capture (and its out-of-memory recovery) and the execution of a step
    llm_engine     the loop: stage, run, sample; generate
"""

from dsv32ref.engine.boundary import BOUNDARIES, Boundary, get_boundary
from dsv32ref.engine.config import EngineConfig
from dsv32ref.engine.input_batch import StepInput
from dsv32ref.engine.llm_engine import LLMEngine
from dsv32ref.engine.model import EngineModel, TensorParallel
from dsv32ref.engine.weights import build_model, from_reference, share_weights, shard

__all__ = ["BOUNDARIES", "Boundary", "EngineConfig", "EngineModel", "LLMEngine", "StepInput", "TensorParallel",
           "build_model", "from_reference", "get_boundary", "share_weights", "shard"]
