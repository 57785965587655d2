"""Attention backends of the serving engine: where the paged cache lives and how attention reads it.

A backend owns one page pool per MLA cache slot (``uint8 [num_pages, page_bytes]`` in the one
:class:`~quantmla.cache.layout.PageLayout`), page 0 of every pool being a null page that padded
batch rows may write and read. Per layer and step the engine calls

    write(slot, latent [N, d_c], k_rope [N, d_r], slot_mapping [N])     quantize-and-write
    attend(slot, q_latent [N, H, d_c], q_rope [N, H, d_r], meta)        -> o_latent [N, H, d_c]

in that order, so every read — the current chunk's own tokens included — sees the quantized cache,
as ``QuantMLACache`` does. ``meta`` (:class:`AttnMeta`) lists the step's tokens as a block of
decode rows (one query per sequence, first in the flat batch) followed by prefill chunks.

``TorchPagedBackend`` is the pure-torch reference: it dequantizes a sequence's pages through the
layout and runs the absorbed-attention oracle. The Triton backend (``triton_backend.py``) runs the
kernels over the same pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.cache.layout import SECTIONS, CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import read_tokens
from quantmla.model.spec import MLASpec
from quantmla.quant.format import PathFormat
from quantmla.quant.groupwise import Quantized, dequantize, quantize
from quantmla.reference.absorbed import absorbed_attention


@dataclass
class Chunk:
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
    chunks: list[Chunk] = field(default_factory=list)
    max_seq_len: int = 0  # upper bound of seq_lens (a static bound under CUDA graphs)
    plan: object | None = None  # a backend's fixed-shape decode schedule (CUDA graphs), else None
    backend_state: dict = field(default_factory=dict)  # per-step scratch a backend shares across layers


# -- the layout's records, in plain torch ---------------------------------------------------------

def encode_path(x: torch.Tensor, fmt: PathFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, D] -> (codes uint8 [N, code_bytes], meta uint8 [N, meta_bytes] or None)."""
    if not fmt.quantized:
        return x.to(torch.bfloat16).contiguous().view(torch.uint8), None
    q = quantize(x, fmt)
    return q.codes, q.meta.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def decode_path(codes: torch.Tensor, meta: torch.Tensor | None, fmt: PathFormat, dim: int) -> torch.Tensor:
    """Inverse of :func:`encode_path` -> fp32 [N, dim]."""
    if not fmt.quantized:
        return codes.contiguous().view(torch.bfloat16).float()
    m = meta.contiguous().view(fmt.torch_meta_dtype).reshape(codes.shape[0], fmt.groups(dim), fmt.meta_fields)
    return dequantize(Quantized(codes, m), fmt, dim, torch.float32)


def section_view(pool: torch.Tensor, layout: PageLayout, name: str) -> torch.Tensor | None:
    """[num_pages, page_size, field_bytes] view of one section of every page (None if empty)."""
    fb = layout.token.field_bytes[name]
    if fb == 0:
        return None
    off = layout.offsets[name]
    return pool[:, off: off + layout.page_size * fb].view(pool.shape[0], layout.page_size, fb)


def write_records(pool: torch.Tensor, layout: PageLayout, latent: torch.Tensor, k_rope: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Quantize tokens and store their records at slots (page · page_size + offset)."""
    fmt = layout.token.fmt
    cc, cm = encode_path(latent, fmt.content)
    rc, rm = encode_path(k_rope, fmt.rope)
    page, off = slot_mapping // layout.page_size, slot_mapping % layout.page_size
    for name, data in zip(SECTIONS, (cc, rc, cm, rm)):
        sec = section_view(pool, layout, name)
        if sec is not None:
            sec[page, off] = data


def read_records(pool: torch.Tensor, layout: PageLayout, block_table: torch.Tensor, seq_len: int):
    """Dequantized (latent [T, d_c], k_rope [T, d_r]) fp32 of one sequence's first seq_len tokens."""
    fmt, t = layout.token.fmt, layout.token
    npages = -(-seq_len // layout.page_size)
    pages = block_table[:npages].long()
    fields = {}
    for name in SECTIONS:
        sec = section_view(pool, layout, name)
        fields[name] = None if sec is None else sec[pages].reshape(-1, sec.shape[-1])[:seq_len]
    latent = decode_path(fields["content_codes"], fields["content_meta"], fmt.content, t.d_c)
    k_rope = decode_path(fields["rope_codes"], fields["rope_meta"], fmt.rope, t.d_r)
    return latent, k_rope


def dense_attention(q_lat, q_rope, latent, k_rope, scale: float, compute_dtype=None) -> torch.Tensor:
    """Causal absorbed attention of n queries (the last n of T positions) over one sequence:
    q [n, H, ·], cache [T, ·] -> o [n, H, d_c] fp32."""
    n, T = q_lat.shape[0], latent.shape[0]
    if compute_dtype is None:
        compute_dtype = torch.float32 if latent.is_cuda else torch.float64
    o, _ = absorbed_attention(q_lat[None], q_rope[None], latent[None], k_rope[None], scale,
                              torch.tensor([T], device=latent.device), causal=True, compute_dtype=compute_dtype)
    return o[0].float()


def chunk_attention(q_lat, q_rope, latent, k_rope, scale: float, max_scores: int = 1 << 26,
                    masks: dict | None = None) -> torch.Tensor:
    """As :func:`dense_attention`, with plain matmuls in the queries' dtype (fp32 accumulation, one rounding
    of the scaled scores) and a softmax that accumulates in fp32, in query blocks of at most `max_scores`
    scores (GPU prefill chunks). Only the chunk's own columns are masked; `masks` (a dict kept for one
    step) shares the causal masks between layers. Deliberately not SDPA: its fused kernels are not needed
    here and one of them gave wrong rows for 160/128-wide heads on the H200."""
    n, H, d_c = q_lat.shape
    T = latent.shape[0]
    dt = q_lat.dtype
    kc, kr = latent.to(dt), k_rope.to(dt)
    out = torch.empty(n, H, d_c, device=q_lat.device, dtype=torch.float32)
    block = max(1, min(n, max_scores // max(1, H * T)))
    past = T - n  # keys every query of the chunk sees
    for s in range(0, n, block):
        e = min(n, s + block)
        ql = q_lat[s:e].reshape(-1, d_c)  # [(b·H), d_c], rows (query, head)
        qr = q_rope[s:e].to(dt).reshape(-1, kr.shape[-1])
        sc = torch.addmm(kc.new_empty(()), ql, kc.T, beta=0, alpha=scale)  # [(b·H), T], scaled before rounding
        sc.addmm_(qr, kr.T, alpha=scale)
        own = sc.view(e - s, H, T)[:, :, past + s:]  # the chunk's keys from this block's first query on
        causal = None if masks is None else masks.get((n, s, e))
        if causal is None:
            causal = torch.ones(e - s, n - s, dtype=torch.bool, device=sc.device).triu_(1)
            if masks is not None:
                masks[(n, s, e)] = causal
        own.masked_fill_(causal[:, None, :], float("-inf"))
        p = torch.softmax(sc, dim=-1)
        out[s:e] = (p @ kc).float().view(e - s, H, d_c)
    return out


class AttentionBackend:
    """Base: the page pools of every MLA slot. Subclasses implement write/attend."""

    name = "base"
    graph_safe = False  # its write/attend can be captured in a CUDA graph

    def __init__(self, spec: MLASpec, formats: dict[int, CacheFormat], num_pages: int, page_size: int,
                 device: torch.device | str, dtype: torch.dtype):
        self.spec, self.page_size = spec, page_size
        self.device, self.dtype = torch.device(device), dtype
        self.num_pages = num_pages  # usable pages; the pool has one more (page 0, the null page)
        self.layouts = {s: PageLayout(TokenLayout(spec.d_c, spec.d_r, f), page_size) for s, f in formats.items()}
        self.pools = {s: torch.zeros(num_pages + 1, lay.page_bytes, dtype=torch.uint8, device=self.device)
                      for s, lay in self.layouts.items()}

    @staticmethod
    def bytes_per_page(spec: MLASpec, formats: dict[int, CacheFormat], page_size: int) -> int:
        return sum(PageLayout(TokenLayout(spec.d_c, spec.d_r, f), page_size).page_bytes for f in formats.values())

    def write(self, slot: int, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def attend(self, slot: int, q_lat: torch.Tensor, q_rope: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        raise NotImplementedError

    def read(self, slot: int, block_table: torch.Tensor, seq_len: int):
        return read_records(self.pools[slot], self.layouts[slot], block_table, seq_len)

    def static_plan(self, b: int, max_len: int):
        """A fixed-shape decode schedule for a CUDA-graph bucket of b rows (none needed here)."""
        return _NoPlan()


class _NoPlan:
    def update(self, lens) -> None:
        pass


class TorchPagedBackend(AttentionBackend):
    """Pure torch: the layout's writer, a per-sequence dequantizing reader, the absorbed oracle."""

    name = "torch"

    def write(self, slot, latent, k_rope, slot_mapping):
        write_records(self.pools[slot], self.layouts[slot], latent, k_rope, slot_mapping)

    def attend(self, slot, q_lat, q_rope, meta):
        scale = self.spec.softmax_scale
        out = torch.empty(q_lat.shape, dtype=torch.float32, device=q_lat.device)
        seq_lens = meta.seq_lens.tolist() if meta.num_decode else []
        for b in range(meta.num_decode):
            lat, kr = self.read(slot, meta.block_tables[b], seq_lens[b])
            out[b: b + 1] = dense_attention(q_lat[b: b + 1], q_rope[b: b + 1], lat, kr, scale)
        for c in meta.chunks:
            if c.slots is not None:
                lat, kr = read_tokens(self.pools[slot], self.layouts[slot], c.slots)
            else:
                lat, kr = self.read(slot, c.block_table, c.seq_len)
            out[c.start: c.start + c.n] = dense_attention(q_lat[c.start: c.start + c.n], q_rope[c.start: c.start + c.n],
                                                          lat, kr, scale)
        return out
