"""The engine's settings (:class:`EngineConfig`) and the figures of a generation job (:class:`JobStats`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral, Real

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.layout import DEFAULT_PAGE_SIZE
from quantmla.errors import QuantMLAError
from quantmla.serving.scheduler import SchedulerStats


GRAPH_UNITS = ("length", "rows")  # EngineConfig.graph_units


@dataclass
class EngineConfig:
    """quant: cache formats (None: BF16 on both paths). The pool size is ``num_pages`` or, from
    ``kv_budget_bytes``, as many pages as the budget holds over all MLA layers (page data only;
    block tables are a few bytes per page more). ``max_num_batched_tokens``: tokens per step
    (prefill chunk budget); ``max_num_seqs``: sequences per step; ``watermark``: fraction of pages
    admission leaves free; ``backend``: "auto", "torch" or "triton"; ``max_model_len``: longest
    sequence (sets the CUDA-graph block-table width; default: what the pool holds); ``decode_config``:
    the Triton decode kernel's tiling per page layout, a function called as
    ``kernels.api.default_config(rows, layout, device)`` is, returning a config or None (None, or no function: that
    default, with FP8 over short work units on the built-tile kernel and 4-bit content codes over short units on the
    tokens-as-M kernel's 4-warp plan, as ``get_mla_metadata`` takes them; a config given is used as it is; without a
    function, the engine gives a ``latent_range.WideLatentsConfig``, which decodes layouts whose latents' scales the
    tokens-as-M kernel's default builds cannot hold on its SCALE_VOTE build, those unit-length rules applied to it);
    ``rope_pages``: store
    the RoPE path per channel per page (one scale and zero point per channel of each page, the method
    ``quantmla-rope-channel`` evaluates), keeping the full-precision keys of the pages being filled in a
    stage of max_num_seqs rows per layer that the KV budget pays for; ``rope_block`` (with rope_pages): the
    tokens sharing one scale and zero point per channel inside a page, a power of two dividing page_size (0: the
    whole page; 16 at page 64 stores the KIVI-style baseline's bytes at groups 32/16). ``fused_norms``: inside steps on CUDA,
    the model's RMSNorm modules run as one Triton kernel a call where a probe shows they compute the same
    (``serving/norms.py``; ``Engine.norms`` says which). ``fused_rope``: inside steps the query's and key's RoPE in
    one kernel a layer where a probe shows it computes what the family's function does (``serving/fused_rope.py``;
    ``Engine.rope`` says "fused" or why not). ``merged_projections``: inside steps the products that read one input
    as one GEMM of their stacked weights (the weights become views of it: ``serving/merged.py``), the query's first
    projection with ``kv_a_proj_with_mqa`` (``Engine.projections`` says "merged" or why not) and, on CUDA, each
    gated MLP's gate with up, its SiLU and product then one kernel (``serving/mlp.py``; ``Engine.mlps`` says which).
    ``overlap_steps``: a pure decode step replayed from a CUDA graph is launched before the previous one's tokens
    reach the host, its input tokens taken from that step's output on the device (``serving/overlap.py``), so
    the GPU does not idle while the host schedules (not with ``rope_pages``). ``graph_units``: how a decode step
    replayed from a CUDA graph deals its bucket's fixed work units out before each replay: "length" (in proportion to
    the real sequences' lengths, as ``get_mla_metadata`` would for them: ``serving.triton_backend.bucket_schedule``)
    or "rows" (the same number to every row of the bucket, padded rows too: the schedule to measure against).
    ``mixed_decode_graphs``: in a step whose prompt chunks run eagerly and hold at most this many tokens, the decode
    rows replay their decode graph beside the chunks' forward instead of joining it (0: never): a second pass over
    the weights on the GPU, in place of the eager decode rows' launches on the host."""

    quant: QuantCacheConfig | None = None
    kv_budget_bytes: int | None = None
    num_pages: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    backend: str = "auto"
    cuda_graphs: bool | str = True  # "emulate": run the graph steps' padded static path uncaptured (CPU tests)
    max_model_len: int | None = None
    keep_logits: bool = False
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
    prefill_graphs: bool = True  # whole-prompt chunks replay graphs padded to a token bucket (with cuda_graphs)
    prefill_graph_min: int = 128  # smallest prefill bucket (tokens)
    prefill_graph_max: int = 4096  # no bucket above it: longer first chunks keep the GPU busier than their launches
    # take, so they run eagerly, unpadded
    decode_config: Callable | None = None  # (rows, layout, device) -> DecodeConfig
    rope_pages: bool = False
    rope_block: int = 0
    fused_norms: bool = True
    fused_rope: bool = True
    merged_projections: bool = True
    overlap_steps: bool = True
    graph_units: str = "length"
    mixed_decode_graphs: int = 0

    def check(self) -> None:
        """QuantMLAError naming the first setting out of its range (the engine checks before it builds anything)."""
        def whole(name: str, least: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, Integral) or isinstance(v, bool) or v < least:
                raise QuantMLAError(f"EngineConfig.{name} = {v!r}: it takes a whole number of at least {least}")

        for name, least in (("page_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                            ("prefill_graph_min", 1), ("rope_block", 0), ("mixed_decode_graphs", 0)):
            whole(name, least)
        for name in ("num_pages", "max_model_len"):
            if getattr(self, name) is not None:
                whole(name, 1)
        v = self.kv_budget_bytes
        if v is not None and (not isinstance(v, Real) or isinstance(v, bool) or v < 1):
            raise QuantMLAError(f"EngineConfig.kv_budget_bytes = {v!r}: give the KV budget in bytes, at least 1")
        if self.num_pages is not None and self.kv_budget_bytes is not None:
            raise QuantMLAError(f"EngineConfig: num_pages {self.num_pages} and kv_budget_bytes {self.kv_budget_bytes} "
                                "both size the pool; give one")
        if self.cuda_graphs not in (True, False, "emulate"):
            raise QuantMLAError(f"EngineConfig.cuda_graphs = {self.cuda_graphs!r}: True, False or 'emulate'")
        whole("prefill_graph_max", 1)
        if not 0.0 <= self.watermark < 1.0:
            raise QuantMLAError(f"EngineConfig.watermark = {self.watermark!r}: the fraction of pages admission leaves "
                                "free, at least 0 and below 1")
        b = self.graph_buckets
        if self.cuda_graphs and (len(b) == 0 or any(not isinstance(x, Integral) or isinstance(x, bool) or x < 1
                                                    for x in b)):
            raise QuantMLAError(f"EngineConfig.graph_buckets = {b!r}: the decode graphs' rows, one or more whole "
                                "numbers of at least 1 (cuda_graphs=False turns the graphs off)")
        if self.prefill_graph_max < 2:
            raise QuantMLAError(f"prefill_graph_max {self.prefill_graph_max}: a prefill chunk has 2 tokens or more, so "
                                "the largest prefill graph needs at least 2 (prefill_graphs=False turns them off)")
        if self.graph_units not in GRAPH_UNITS:
            raise QuantMLAError(f"graph_units {self.graph_units!r}: use one of {', '.join(GRAPH_UNITS)}")
        if self.rope_block and not self.rope_pages:
            raise QuantMLAError(f"rope_block {self.rope_block} sets the RoPE scales' blocks inside a page: it needs "
                                "rope_pages=True")


@dataclass
class JobStats:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    graph_steps: int = 0
    eager_steps: int = 0
    prefill_graph_steps: int = 0  # steps whose whole-prompt chunks (and decode rows) replayed graphs, the rest eager
    mixed_graph_steps: int = 0  # steps whose decode rows replayed a graph beside eager chunks (mixed_decode_graphs)
    eager_chunks: int = 0  # chunks of those steps that ran eagerly (a later part, or a first chunk above the graphs)
    graph_decode_s: float = 0.0  # time in decode steps replayed from CUDA graphs
    eager_decode_steps: int = 0  # pure decode steps run eagerly
    eager_decode_s: float = 0.0
    mixed_s: float = 0.0  # steps with prefill chunks

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "scheduler"}
        d["tokens_per_s"] = self.tokens_per_s
        d.update({f"sched_{k}": v for k, v in self.scheduler.to_dict().items()})
        return d
