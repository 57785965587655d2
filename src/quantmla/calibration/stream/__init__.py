"""Layer-streamed calibration of checkpoints that never fit in memory whole (docs/scaling.md).

Modules by job: ``files`` (atomic writes, safetensors headers and streamed shards), ``memory``
(resident set and weight accounting), ``source`` (the sharded / block-FP8 checkpoint and the
meta-device model skeleton), ``activations`` (hidden states between layers), ``fitters`` (per-layer
fits), ``state`` (manifest, done-markers, resume checkpoints, report) and ``run`` (the orchestrator,
:func:`calibrate_streamed`). Multi-process runs: :mod:`quantmla.calibration.distributed`.
"""

from quantmla.calibration.outdir import STATE_DIR
from quantmla.calibration.stream.fitters import FitFn, LayerFitter, ProjectFitter, RecordsFitter
from quantmla.calibration.stream.run import Streamer, calibrate_streamed
from quantmla.calibration.stream.source import ShardedCheckpoint, Skeleton
from quantmla.calibration.stream.state import LayerStats, RunState, StreamReport

__all__ = [
    "STATE_DIR", "FitFn", "LayerFitter", "LayerStats", "ProjectFitter", "RecordsFitter", "RunState", "ShardedCheckpoint",
    "Skeleton", "StreamReport", "Streamer", "calibrate_streamed",
]
