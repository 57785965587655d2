"""Attention backends of the serving engine: where the paged cache lives and how attention reads it.

A backend owns the engine's :class:`~quantmla.cache.paged.PagePool`: one ``uint8 [1 + num_pages,
page_bytes]`` view per MLA cache slot in that slot's :class:`~quantmla.cache.layout.PageLayout`, page 0
(``NULL_PAGE``) being the page that padded batch rows may write and read. Per layer and step the engine calls

    write(slot, latent [N, d_c], k_rope [N, d_r], slot_mapping [N], stage_rows)  quantize-and-write
    attend(slot, view, q_nope [N, H, d_n], q_rope [N, H, d_r], meta)         -> values [N, H, d_v]

in that order, so every read — the current chunk's own tokens included — sees the quantized cache,
as ``QuantMLACache`` does. ``meta`` (:class:`AttnMeta`) lists the step's tokens as a block of
decode rows (one query per sequence, first in the flat batch) followed by prefill chunks. Decode
rows attend in the absorbed form (``decode``: absorbed queries against the latent pages); prefill
chunks as each backend's ``prefill`` chooses.

A slot whose RoPE path is grouped per page (``PathFormat(grouping="page")``) also has a *stage*,
``rope_stage[slot]`` ``[stage_rows, page_size, d_r]`` in the model's dtype (fp32 unless bf16): one row per sequence that is filling a page
(row 0 is the null row of padded batch rows), holding that page's full-precision keys so far; the
engine gives each token's row (``AttnMeta.stage_rows``) and each write requantizes the pages it touches.

``TorchPagedBackend`` is the pure-torch reference: it writes and reads records with the layout's
torch reference (``cache.paged``) and runs the absorbed-attention oracle for both kinds of rows. The
Triton backend (``triton_backend.py``) runs the kernels over the same pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import PagePool, read_tokens, slot_of, write_tokens, write_tokens_staged
from quantmla.errors import UnsupportedFormatError
from quantmla.model.spec import MLASpec
from quantmla.model.view import MLAView
from quantmla.reference.absorbed import absorbed_attention


@dataclass
class PrefillChunk:
    """A prefill chunk: flat tokens [start, start + n) of one sequence whose cache holds seq_len tokens
    after this step's write (the chunk's queries are its last n positions)."""

    start: int
    n: int
    seq_len: int
    block_table: torch.Tensor  # [pages] int32 on the device
    num_pages: int = 0
    slots: torch.Tensor | None = None  # [seq_len] int64 on the device: the slot of each cached position


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor  # [N] int64: page * page_size + offset of each token
    num_decode: int = 0  # flat tokens [0, num_decode) are single-query rows
    block_tables: torch.Tensor | None = None  # [num_decode, W] int32
    seq_lens: torch.Tensor | None = None  # [num_decode] int32 (after this step's write)
    chunks: list[PrefillChunk] = field(default_factory=list)
    max_seq_len: int = 0  # upper bound of seq_lens (a static bound under CUDA graphs)
    plan: object | None = None  # a backend's fixed-shape decode schedule (CUDA graphs), else None
    # eager decode rows: (buckets, max_seq_len) of the decode graphs whose combine shape they take, the bucket that
    # holds them first, then the smaller ones (None: no decode graphs)
    graph_buckets: tuple[tuple[int, ...], int] | None = None
    stage_rows: torch.Tensor | None = None  # [N] int32: each token's row in the RoPE stage (per-page RoPE paths)
    backend_state: dict = field(default_factory=dict)  # per-step scratch a backend shares across layers


def stage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The RoPE stage holds the model's keys exactly: bf16 for a bf16 model, fp32 otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def dense_attention(q_lat, q_rope, latent, k_rope, scale: float, compute_dtype=None) -> torch.Tensor:
    """Causal absorbed attention of n queries (the last n of T positions) over one sequence:
    q [n, H, ·], cache [T, ·] -> o [n, H, d_c] fp32."""
    T = latent.shape[0]
    if compute_dtype is None:
        compute_dtype = torch.float32 if latent.is_cuda else torch.float64
    o, _ = absorbed_attention(q_lat[None], q_rope[None], latent[None], k_rope[None], scale,
                              torch.tensor([T], device=latent.device), causal=True, compute_dtype=compute_dtype)
    return o[0].float()


class AttentionBackend:
    """Base: the page pools of every MLA slot. Subclasses implement write/attend."""

    name = "base"
    graph_safe = False  # its write/attend can be captured in a CUDA graph
    fallback_reason: str | None = None  # why backend="auto" took this one instead of the Triton kernels

    def __init__(self, spec: MLASpec, formats: dict[int, CacheFormat], num_pages: int, page_size: int,
                 device: torch.device | str, dtype: torch.dtype, stage_rows: int = 0):
        per_page = sorted(s for s, f in formats.items() if f.rope.per_page)
        if per_page and stage_rows < 2:
            raise UnsupportedFormatError(
                f"cache slots {per_page} group the RoPE path per page ({formats[per_page[0]].rope.describe()}): the "
                "backend needs a RoPE stage of at least 2 rows (the null row and one per sequence filling a page)")
        self.spec, self.page_size = spec, page_size
        self.device, self.dtype = torch.device(device), dtype
        self.num_pages = num_pages  # usable pages; the pool has one more (page 0, the null page)
        self.layouts = self.page_layouts(spec, formats, page_size)
        self.pool = PagePool(self.layouts, num_pages, device=self.device, null_page=True)
        sd = stage_dtype(dtype)
        self.rope_stage = {s: torch.zeros(stage_rows, page_size, spec.d_r, dtype=sd, device=self.device) for s in per_page}

    @staticmethod
    def page_layouts(spec: MLASpec, formats: dict[int, CacheFormat], page_size: int) -> dict[int, PageLayout]:
        """Cache slot -> the page layout its format gives at the model's d_c and d_r: the pool's, the kernels' and
        the engine's one source."""
        return {s: PageLayout(TokenLayout(spec.d_c, spec.d_r, f), page_size) for s, f in formats.items()}

    @staticmethod
    def bytes_per_page(spec: MLASpec, formats: dict[int, CacheFormat], page_size: int) -> int:
        return sum(lay.page_bytes for lay in AttentionBackend.page_layouts(spec, formats, page_size).values())

    @staticmethod
    def stage_bytes(spec: MLASpec, formats: dict[int, CacheFormat], page_size: int, stage_rows: int,
                    dtype: torch.dtype) -> int:
        """Bytes of the RoPE stages of the per-page slots ([stage_rows, page_size, d_r] each, stage_dtype(dtype))."""
        size = stage_dtype(dtype).itemsize
        return sum(stage_rows * page_size * spec.d_r * size for f in formats.values() if f.rope.per_page)

    def write(self, slot: int, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor,
              stage_rows: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def attend(self, slot: int, view: MLAView, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """Per-head values [N, H, d_v] in q_nope's dtype of the step's rows: decode rows absorbed
        (``q_nope · W_UK`` -> :meth:`decode` -> ``W_UV``), prefill chunks by :meth:`prefill`."""
        N, H, _ = q_nope.shape
        out = q_nope.new_empty((N, H, self.spec.d_v))
        nd = meta.num_decode
        if nd:  # the absorbed queries and the values written in the kernels' and o_proj's layouts: no copies
            o = self.decode(slot, view.absorb_rows(q_nope[:nd]), q_rope[:nd], meta)  # [nd, H, d_c]
            view.values_rows(o.to(q_nope.dtype), out=out[:nd])
        for c in meta.chunks:
            rows = slice(c.start, c.start + c.n)
            out[rows] = self.prefill(slot, view, c, q_nope[rows], q_rope[rows])
        return out

    def decode(self, slot: int, q_lat: torch.Tensor, q_rope: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """Latent-space outputs [nd, H, d_c] of the decode rows (absorbed queries [nd, H, d_c])."""
        raise NotImplementedError

    def prefill(self, slot: int, view: MLAView, c: PrefillChunk, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """Values [n, H, d_v] of one chunk's queries over its context (the chunk's own tokens included)."""
        raise NotImplementedError

    def context(self, slot: int, c: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's context read back dequantized: latent [T, d_c], k_rope [T, d_r] fp32."""
        if c.slots is not None:
            return read_tokens(self.pool.layer(slot), self.layouts[slot], c.slots)
        return self.read(slot, c.block_table, c.seq_len)

    def read(self, slot: int, block_table: torch.Tensor, seq_len: int):
        """Dequantized (latent [T, d_c], k_rope [T, d_r]) fp32 of one sequence's first seq_len tokens."""
        p = torch.arange(seq_len, device=block_table.device)
        return read_tokens(self.pool.layer(slot), self.layouts[slot], slot_of(block_table.long(), p, self.page_size))

    def static_plan(self, b: int, max_len: int):
        """A fixed-shape decode schedule for a CUDA-graph bucket of b rows (none needed here)."""
        return _NoPlan()


class _NoPlan:
    def update(self, lens, buffer: int = 0) -> None:
        pass


class TorchPagedBackend(AttentionBackend):
    """Pure torch: the layout's writer, a per-sequence dequantizing reader, the absorbed oracle."""

    name = "torch"

    def write(self, slot, latent, k_rope, slot_mapping, stage_rows=None):
        if slot in self.rope_stage:
            write_tokens_staged(self.pool.layer(slot), self.layouts[slot], slot_mapping, latent, k_rope,
                                self.rope_stage[slot], stage_rows)
        else:
            write_tokens(self.pool.layer(slot), self.layouts[slot], slot_mapping, latent, k_rope)

    def decode(self, slot, q_lat, q_rope, meta):
        scale = self.spec.softmax_scale
        out = torch.empty(q_lat.shape, dtype=torch.float32, device=q_lat.device)
        seq_lens = meta.seq_lens.tolist()
        for b in range(meta.num_decode):
            lat, kr = self.read(slot, meta.block_tables[b], seq_lens[b])
            out[b: b + 1] = dense_attention(q_lat[b: b + 1], q_rope[b: b + 1], lat, kr, scale)
        return out

    def prefill(self, slot, view, c, q_nope, q_rope):
        lat, kr = self.context(slot, c)
        o = dense_attention(view.absorb_rows(q_nope), q_rope, lat, kr, self.spec.softmax_scale)  # the absorbed oracle
        return view.values_rows(o.to(q_nope.dtype))
