"""The Triton attention backend: the kernel engineer's kernels (``quantmla.kernels``) over the pools.

- write: ``append_to_pages`` (quantize, pack, write at slots), bit-exact with the torch writer;
- decode rows: one ``mla_decode_with_kvcache`` call over all single-query rows of the step, absorbed;
- prefill chunks: the chunk's context is read back dequantized (``read_from_pages``, one launch),
  up-projected by the model's own ``kv_b_proj`` and attended by ``mla_prefill_attention`` in the
  non-absorbed form (a chunk's many queries share the up-projection, so each (query, key) pair costs
  d_n + d_r + d_v multiply-adds per head instead of 2·d_c + d_r).

Under CUDA graphs the decode split schedule must have a fixed shape: :class:`StaticDecodePlan` keeps,
per batch-size bucket, a fixed number of work units and, before each replay, deals them out to the real
sequences in proportion to their lengths (:func:`bucket_schedule`): it rewrites the unit rows (sequence,
token start, token end, splits) and each sequence's (first unit, splits) that the combine kernel reads.
"""

from __future__ import annotations

import numpy as np
import torch

from quantmla.cache.layout import CacheFormat, PageLayout
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
        for lay in AttentionBackend.page_layouts(spec, formats, page_size).values():
            api.check_layout_supported(lay)
    except UnsupportedFormatError as e:
        return False, str(e)
    return True, ""


class StaticDecodePlan:
    """Fixed-shape decode schedules (one per page layout kind) for a CUDA-graph bucket of b rows.

    The graph fixes the number of work units, U = b × S, S chosen so that the bucket fills the GPU
    (about ``num_sms × ctas_per_sm`` programs, as :func:`get_mla_metadata` aims for) but no split of a
    max-length row is shorter than the config's ``min_chunk``. Before each replay :meth:`update` deals the
    U units out to the real rows by length (:func:`bucket_schedule`), as ``get_mla_metadata`` would for
    those lengths: a bucket that holds fewer or shorter sequences than its rows gives each of them more
    splits, and a long sequence gets more than a short one, so the one wave of programs ends when the
    longest span does, not the longest sequence's S-th part (``by_length=False``: S to every row)."""

    def __init__(self, backend: TritonPagedBackend, b: int, max_len: int, by_length: bool = True):
        from quantmla.kernels import schedule

        api = _kernels()
        self.b, self.max_len, self.by_length = b, max_len, by_length
        H, dev = backend.spec.num_heads, backend.device
        self.md: dict[tuple, object] = {}
        self.split: dict[tuple, tuple[int, int, int]] = {}  # kind -> (splits per row, shortest span, tile)
        self.host: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind, layout in backend.kinds.items():
            cfg = decode_tiling(backend, layout, b, max_len)
            S, chunk, min_span = bucket_splits(cfg, H, b, max_len, schedule.num_sms_of(dev))
            proto = api.get_mla_metadata(torch.full((b,), max_len, dtype=torch.int32, device=dev), H, 1, layout,
                                         config=cfg, chunk_tokens=chunk)
            if proto.max_splits != S or proto.num_units != b * S:
                raise RuntimeError("unexpected decode schedule shape")  # uniform lengths give b·S units
            proto.combine = schedule.combine_shape(b, H, layout.token.d_c, S, schedule.num_sms_of(dev))
            proto.lengths = None  # update() deals the units out to each replay's real lengths
            self.md[kind], self.split[kind] = proto, (S, min_span, cfg.block_n)
            # two pinned sets used in turn: a step's units may still be on their way while the next is prepared
            pin = dev.type == "cuda"
            self.host[kind] = (torch.zeros(2, b * S, 4, dtype=torch.int32, pin_memory=pin),
                               torch.zeros(2, b, 2, dtype=torch.int32, pin_memory=pin))

    def update(self, lens: np.ndarray, buffer: int = 0) -> None:
        """lens: int [b] real lengths (padded rows 1). Rewrites every kind's work units and per-sequence
        (first unit, splits) in place, through pinned host set ``buffer`` (0 or 1)."""
        for kind, md in self.md.items():
            S, min_span, tile = self.split[kind]
            units, info = self.host[kind]
            units[buffer].numpy()[:], info[buffer].numpy()[:] = bucket_schedule(lens, self.b * S, min_span, tile,
                                                                                self.by_length)
            md.units.copy_(units[buffer], non_blocking=True)
            md.seq_info.copy_(info[buffer], non_blocking=True)


def follows_units(decode_config) -> bool:
    """Whether the API's unit-length rules (``schedule.config_for_units``) apply to the configs that a backend's
    `decode_config` gives, as to the default: True only where its class declares ``follows_units = True``
    (``latent_range.WideLatentsConfig``, the engine's own); a plain function (an attribute set on it included), or
    None, keeps its configs as given."""
    return getattr(type(decode_config), "follows_units", False) is True


def decode_tiling(backend, layout: PageLayout, b: int, max_len: int):
    """The decode tiling (``DecodeConfig``) of `layout` at the backend's heads for a graph bucket of `b` rows up to
    `max_len` tokens: the backend's ``decode_config`` where it gives one, else the API's default for the units that
    bucket cuts a `max_len` row into (``schedule.config_for_units``: FP8 over short units on the built tile, 4-bit
    content codes over short units on the tokens-as-M kernel's 4-warp plan, with one token block a warp where the
    bucket's b·S CTAs fit one an SM, as an eager call's ``get_mla_metadata`` reads b rows of `max_len` tokens; the
    graph keeps that choice for shorter real rows, whose units are shorter). A ``decode_config`` that declares
    ``follows_units`` (:func:`follows_units`: ``latent_range.WideLatentsConfig``) gives the config those rules start
    from; any other keeps the config it gives."""
    from quantmla.kernels import schedule

    H, dev, own = backend.spec.num_heads, backend.device, backend.decode_config
    cfg = None if own is None else own(H, layout, dev)
    if cfg is not None and not follows_units(own):
        return cfg
    cfg = cfg or _kernels().default_config(H, layout, dev)
    sms = schedule.num_sms_of(dev)
    S, chunk, _ = bucket_splits(cfg, H, b, max_len, sms)
    return schedule.config_for_units(cfg, H, layout, dev, chunk, b * S * -(-H // cfg.block_m) <= sms)


def bucket_splits(cfg, H: int, b: int, max_len: int, num_sms: int) -> tuple[int, int, int]:
    """A graph bucket's splits of each row for decode config `cfg` (a ``DecodeConfig``) at H heads: (S, the split's
    tokens, the shortest span in tokens). S makes b·S programs one wave of ``num_sms × ctas_per_sm`` (not a partial
    second) where no split of a `max_len` row is shorter than the config's ``min_chunk``; the splits are whole key
    tiles, evened out as ``get_mla_metadata`` cuts them, so S can come out below that."""
    from quantmla.kernels.schedule import cut_units

    head_blocks = -(-H // cfg.block_m)
    target = max(1, num_sms * cfg.ctas_per_sm // head_blocks)
    min_span = -(-max(cfg.min_chunk, 1) // cfg.block_n) * cfg.block_n
    S = max(1, min(target // b, -(-max_len // min_span)))
    per = -(-max_len // S)  # tokens a split
    chunk = max(1, -(-per // cfg.block_n)) * cfg.block_n  # in whole tiles
    _, info = cut_units(np.array([max_len]), chunk // cfg.block_n, cfg.block_n)
    return int(info[0, 1]), chunk, min_span


def bucket_schedule(lens: np.ndarray, num_units: int, min_span: int, tile: int,
                    by_length: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A graph bucket's work for real lengths: (units int64 [num_units, 4] rows (sequence, token start, token end,
    splits), seq_info int64 [b, 2] rows (first unit, splits)), num_units >= b.

    Every sequence is cut into spans of whole key tiles of `tile` tokens, each at most c tiles, c the fewest (and at
    least `min_span` tokens) for which the spans fit in `num_units`; a sequence's spans are then evened out (equal
    whole tiles, the last one shorter), so its splits are ceil(len / c tiles) and work follows length. A sequence of
    0 tokens has one empty unit. The units past the last sequence's are empty, say 2 splits and name sequence 0:
    the kernels write only their own partial rows, which no sequence's combine reads (they exist only where the
    bucket has more units than sequences, so it always has partial rows).

    by_length=False: every row gets num_units // b splits of ceil(len / splits) tokens (at least `min_span`, whole
    tiles), empty past its end, whatever the other rows' lengths."""
    from quantmla.kernels.schedule import cut_units, fewest_tiles

    n = np.asarray(lens, dtype=np.int64).reshape(-1)
    b = n.shape[0]
    if num_units < b:
        raise ValueError(f"{num_units} units cannot hold {b} sequences")
    if not by_length:
        S = num_units // b
        span = -(-np.maximum(min_span, -(-n // S)) // tile) * tile
        i = np.arange(S)[None, :]
        units = np.zeros((b, S, 4), dtype=np.int64)
        units[:, :, 0] = np.arange(b)[:, None]
        units[:, :, 1] = np.minimum(n[:, None], i * span[:, None])
        units[:, :, 2] = np.minimum(n[:, None], (i + 1) * span[:, None])
        units[:, :, 3] = S
        return units.reshape(-1, 4), np.stack([np.arange(b) * S, np.full(b, S)], axis=1)
    cut, info = cut_units(n, fewest_tiles(-(-n // tile), num_units, -(-min_span // tile)), tile)
    units = np.zeros((num_units, 4), dtype=np.int64)
    units[: len(cut)] = cut
    units[len(cut):, 3] = 2
    return units, info


class TritonPagedBackend(AttentionBackend):
    name = "triton"

    def __init__(self, spec, formats, num_pages, page_size, device, dtype, decode_config=None, stage_rows: int = 0,
                 graph_units: str = "length"):
        """decode_config: the decode tiling per page layout, called as ``kernels.api.default_config(rows,
        layout, device)`` is (None: that default; a config it gives is kept as given, unless it declares
        ``follows_units``, :func:`follows_units`); graph_units: how CUDA-graph buckets deal their work units out,
        "length" or "rows" (:class:`StaticDecodePlan`)."""
        api = _kernels()
        for lay in AttentionBackend.page_layouts(spec, formats, page_size).values():
            api.check_layout_supported(lay)
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
        self.graph_units = graph_units
        self._graph_combine: dict[tuple[tuple[int, ...], int], dict] = {}

    def write(self, slot, latent, k_rope, slot_mapping, stage_rows=None):
        stage = self.rope_stage.get(slot)
        _kernels().append_to_pages(self.pool.layer(slot), self.layouts[slot], slot_mapping, latent, k_rope,
                                   rope_stage=stage, stage_rows=None if stage is None else stage_rows)

    def static_plan(self, b: int, max_len: int) -> StaticDecodePlan:
        return StaticDecodePlan(self, b, max_len, by_length=self.graph_units == "length")

    def graph_combine(self, buckets: tuple[int, ...], max_len: int) -> dict:
        """Per layout kind, the combine shape that the first of the decode graph buckets `buckets` (rows, up to
        `max_len` tokens) to launch the combine kernel launches it in, or None where none does (a bucket whose rows
        have one split each launches none). Computed once, without building the buckets' plans."""
        from quantmla.kernels import schedule

        if (buckets, max_len) not in self._graph_combine:
            H, sms = self.spec.num_heads, schedule.num_sms_of(self.device)
            got = {}
            for kind, layout in self.kinds.items():
                got[kind] = next((schedule.combine_shape(b, H, layout.token.d_c, S, sms) for b in buckets
                                  if (S := bucket_splits(decode_tiling(self, layout, b, max_len), H, b, max_len,
                                                         sms)[0]) > 1), None)
            self._graph_combine[buckets, max_len] = got
        return self._graph_combine[buckets, max_len]

    def _metadata(self, slot: int, meta: AttnMeta):
        kind = self.kind_of[slot]
        if meta.plan is not None:
            return meta.plan.md[kind]
        cache = meta.backend_state.setdefault("md", {})
        if kind not in cache:
            H, layout = self.spec.num_heads, self.kinds[kind]
            own = self.decode_config
            cfg = None if own is None else own(H, layout, meta.seq_lens.device)
            combine = None if meta.graph_buckets is None else self.graph_combine(*meta.graph_buckets)[kind]
            cache[kind] = _kernels().get_mla_metadata(meta.seq_lens, H, 1, layout, config=cfg, combine=combine,
                                                      follow_units=follows_units(own))
            cache[kind].lengths = None  # cut from this step's own seq_lens (an inference tensor): no host read a layer
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


__all__ = ["StaticDecodePlan", "TritonPagedBackend", "UnsupportedFormatError", "bucket_schedule", "bucket_splits",
           "decode_tiling", "follows_units", "triton_available"]
