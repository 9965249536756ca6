"""The engine: requests, scheduler, step plans, executor and worker, sampler and Engine (torch)."""

from .config import EngineConfig
from .engine import Engine
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineConfig", "RequestMetrics", "RequestOutput", "SamplingParams"]
