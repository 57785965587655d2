"""``quantmla.serve``: the offline serving engine's public names.

The same objects as :mod:`quantmla.serving` (which also holds the scheduler, the attention backends
and the cache-pressure benchmark); ``quantmla serve`` is its command line.
"""

from quantmla.serving import BF16_CONFIG, Engine, EngineConfig, JobStats, Request, RequestOutput, SamplingParams

__all__ = ["BF16_CONFIG", "Engine", "EngineConfig", "JobStats", "Request", "RequestOutput", "SamplingParams"]
