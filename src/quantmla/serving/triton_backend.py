"""The Triton attention backend: the kernel engineer's kernels (``quantmla.kernels``) over the pools.

- write: ``append_to_pages`` (quantize, pack, write at slots), bit-exact with the torch writer;
- decode rows: one ``mla_decode_with_kvcache`` call over all single-query rows of the step, absorbed;
- prefill chunks: the chunk's context is read back dequantized (``read_from_pages``, one launch),
  up-projected by the model's own ``kv_b_proj`` and attended by ``mla_prefill_attention`` in the
  non-absorbed form (a chunk's many queries share the up-projection, so each (query, key) pair costs
  d_n + d_r + d_v multiply-adds per head instead of 2·d_c + d_r).

Under CUDA graphs the decode split schedule must have a fixed shape: :class:`StaticDecodePlan` keeps,
per batch-size bucket, the split structure of a max-length batch and rewrites its work-unit rows
(sequence, token start, token end, splits) for the real lengths before each replay; units past a
sequence's end are empty and the combine kernel gives them zero weight.
"""

from __future__ import annotations

import numpy as np
import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.errors import UnsupportedFormatError
from quantmla.serving.backends import AttentionBackend, AttnMeta


def _kernels():
    from quantmla.kernels import api

    return api


def triton_available(device: torch.device, spec, formats: dict[int, CacheFormat], page_size: int) -> tuple[bool, str]:
    """Whether the kernels can serve these formats on this device, and why not."""
    try:
        api = _kernels()
    except ImportError as e:
        return False, f"the kernels cannot be imported ({e})"
    if torch.device(device).type != "cuda" and not api.interpreting():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    try:
        for f in formats.values():
            api.check_layout_supported(PageLayout(TokenLayout(spec.d_c, spec.d_r, f), page_size))
    except UnsupportedFormatError as e:
        return False, str(e)
    return True, ""


class StaticDecodePlan:
    """Fixed-shape decode schedules (one per page layout kind) for a CUDA-graph bucket of b rows.

    The graph fixes the number of work units, b × S: S splits per sequence, chosen so that the bucket
    fills the GPU (about ``num_sms × ctas_per_sm`` programs, as :func:`get_mla_metadata` aims for) but
    no split is shorter than the config's ``min_chunk``. Before each replay :meth:`update` cuts every
    real sequence into spans of ``ceil(len / S)`` tokens (at least ``min_chunk``), rounded up to whole
    key tiles so that no tile straddles two splits, so the work follows the real lengths, not the
    graph's worst case (the pool's whole capacity)."""

    def __init__(self, backend: TritonPagedBackend, b: int, max_len: int):
        from quantmla.kernels import schedule

        api = _kernels()
        self.b, self.max_len = b, max_len
        H, dev = backend.spec.num_heads, backend.device
        self.md: dict[tuple, object] = {}
        self.split: dict[tuple, tuple[int, int, int]] = {}  # kind -> (splits per sequence, shortest span, tile)
        self.host: dict[tuple, torch.Tensor] = {}
        for kind, layout in backend.kinds.items():
            cfg = (backend.decode_config or api.default_config)(H, layout, dev)
            head_blocks = -(-H // cfg.block_m)
            target = max(1, schedule.num_sms_of(dev) * cfg.ctas_per_sm // head_blocks)
            min_span = -(-max(cfg.min_chunk, 1) // cfg.block_n) * cfg.block_n
            S = max(1, min(target // b, -(-max_len // min_span)))  # b·S programs: one wave, not a partial second
            proto = api.get_mla_metadata(torch.full((b,), max_len, dtype=torch.int32, device=dev), H, 1, layout,
                                         config=cfg, chunk_tokens=-(-max_len // S))
            S = proto.max_splits
            if proto.num_units != b * S:
                raise RuntimeError("unexpected decode schedule shape")  # uniform lengths give b·S units
            self.md[kind], self.split[kind] = proto, (S, min_span, cfg.block_n)
            # two pinned sets used in turn: a step's units may still be on their way while the next is prepared
            self.host[kind] = torch.zeros(2, b * S, 4, dtype=torch.int32, pin_memory=dev.type == "cuda")

    def update(self, lens: np.ndarray, buffer: int = 0) -> None:
        """lens: int [b] real lengths (padded rows 1). Rewrites every kind's work units in place, through
        pinned host set ``buffer`` (0 or 1)."""
        for kind, md in self.md.items():
            S, min_span, tile = self.split[kind]
            self.host[kind][buffer].numpy().reshape(self.b, S, 4)[:] = bucket_units(lens, S, min_span, tile)
            md.units.copy_(self.host[kind][buffer], non_blocking=True)


def bucket_units(lens: np.ndarray, splits: int, min_span: int, tile: int) -> np.ndarray:
    """A graph bucket's work units: int64 [b, splits, 4] rows (sequence, token start, token end, splits). Sequence i
    is cut into spans of ceil(len / splits) tokens, at least `min_span`, in whole key tiles of `tile` tokens; the
    spans past its end are empty (start = end = len), as most of a bucket's units are."""
    n = np.asarray(lens, dtype=np.int64)[:, None]
    span = np.maximum(min_span, -(-n // splits))  # ceil(len / S) tokens, at least min_span,
    span = -(-span // tile) * tile  # in whole key tiles
    i = np.arange(splits)[None, :]
    units = np.empty((n.shape[0], splits, 4), dtype=np.int64)
    units[:, :, 0] = np.arange(n.shape[0])[:, None]
    units[:, :, 1] = np.minimum(n, i * span)
    units[:, :, 2] = np.minimum(n, (i + 1) * span)
    units[:, :, 3] = splits
    return units


class TritonPagedBackend(AttentionBackend):
    name = "triton"

    def __init__(self, spec, formats, num_pages, page_size, device, dtype, decode_config=None, stage_rows: int = 0):
        """decode_config: the decode tiling per page layout, called as ``kernels.api.default_config(rows,
        layout, device)`` is (None: that default)."""
        api = _kernels()
        for slot, f in formats.items():
            api.check_layout_supported(PageLayout(TokenLayout(spec.d_c, spec.d_r, f), page_size))
        super().__init__(spec, formats, num_pages, page_size, device, dtype, stage_rows)
        # decode schedules differ by layout (block sizes); one per distinct layout
        self.kinds: dict[tuple, PageLayout] = {}
        self.kind_of: dict[int, tuple] = {}
        for slot, lay in self.layouts.items():
            k = (lay.token.fmt.content, lay.token.fmt.rope)
            self.kinds.setdefault(k, lay)
            self.kind_of[slot] = k
        self.graph_safe = self.device.type == "cuda"
        self.decode_config = decode_config

    def write(self, slot, latent, k_rope, slot_mapping, stage_rows=None):
        stage = self.rope_stage.get(slot)
        _kernels().append_to_pages(self.pool.layer(slot), self.layouts[slot], slot_mapping, latent, k_rope,
                                   rope_stage=stage, stage_rows=None if stage is None else stage_rows)

    def static_plan(self, b: int, max_len: int) -> StaticDecodePlan:
        return StaticDecodePlan(self, b, max_len)

    def _metadata(self, slot: int, meta: AttnMeta):
        kind = self.kind_of[slot]
        if meta.plan is not None:
            return meta.plan.md[kind]
        cache = meta.backend_state.setdefault("md", {})
        if kind not in cache:
            H, layout = self.spec.num_heads, self.kinds[kind]
            cfg = None if self.decode_config is None else self.decode_config(H, layout, meta.seq_lens.device)
            cache[kind] = _kernels().get_mla_metadata(meta.seq_lens, H, 1, layout, config=cfg)
        return cache[kind]

    def decode(self, slot, q_lat, q_rope, meta):
        out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)  # contiguous (q_lat is a view)
        _kernels().mla_decode_with_kvcache(
            q_lat.unsqueeze(1), q_rope.unsqueeze(1), self.pool.layer(slot), meta.block_tables, meta.seq_lens,
            self.layouts[slot], self.spec.softmax_scale, metadata=self._metadata(slot, meta), out=out.unsqueeze(1))
        return out

    def prefill(self, slot, view, c, q_nope, q_rope):
        api = _kernels()
        if c.slots is not None:
            lat, kr = api.read_from_pages(self.pool.layer(slot), self.layouts[slot], c.slots, dtype=q_nope.dtype)
        else:
            lat, kr = self.context(slot, c)
        s = self.spec
        kv = view.m.kv_b_proj(lat.to(view.m.kv_b_proj.weight.dtype)).view(-1, s.num_heads, s.d_n + s.d_v)
        return api.mla_prefill_attention(q_nope, q_rope, kv, kr.to(kv.dtype), s.softmax_scale)


__all__ = ["StaticDecodePlan", "TritonPagedBackend", "UnsupportedFormatError", "bucket_units", "triton_available"]
