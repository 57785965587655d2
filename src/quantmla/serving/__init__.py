"""Offline continuous-batching serving of MLA checkpoints on the low-bit paged cache.

    from quantmla.serving import Engine, EngineConfig, Request, SamplingParams
    engine = Engine.from_pretrained("models/<name>", EngineConfig(quant=QuantCacheConfig.of_bits(4, 4),
                                                                  kv_budget_bytes=2 << 30))
    outputs = engine.generate([Request(0, prompt_ids, SamplingParams(max_new_tokens=256))])

``quantmla serve-bench`` (a lab command: ``quantmla_lab.bench.serving``) measures whole-job throughput
under a fixed KV byte budget. ``Engine.observers`` takes :class:`EngineObserver` objects, told of every
step and CUDA-graph capture with host timings (graphs.py).
"""

from quantmla.serving.engine import BF16_CONFIG, Engine, EngineConfig, JobStats
from quantmla.serving.graphs import CaptureTiming, EngineObserver, StepTiming
from quantmla.serving.scheduler import Request, RequestOutput, RequestTooLargeError, SamplingParams

__all__ = ["BF16_CONFIG", "CaptureTiming", "Engine", "EngineConfig", "EngineObserver", "JobStats", "Request",
           "RequestOutput", "RequestTooLargeError", "SamplingParams", "StepTiming"]
