"""Attention backends of the serving engine: where the paged cache lives and how attention reads it.

A backend owns one page pool per MLA cache slot (``uint8 [num_pages, page_bytes]`` in the one
:class:`~quantmla.cache.layout.PageLayout`), page 0 of every pool being a null page that padded
batch rows may write and read. Per layer and step the engine calls

    write(slot, latent [N, d_c], k_rope [N, d_r], slot_mapping [N])     quantize-and-write
    attend(slot, q_latent [N, H, d_c], q_rope [N, H, d_r], meta)        -> o_latent [N, H, d_c]

in that order, so every read — the current chunk's own tokens included — sees the quantized cache,
as ``QuantMLACache`` does. ``meta`` (:class:`AttnMeta`) lists the step's tokens as a block of
decode rows (one query per sequence, first in the flat batch) followed by prefill chunks.

``TorchPagedBackend`` is the pure-torch reference: it writes and reads records with the layout's
torch reference (``cache.paged``) and runs the absorbed-attention oracle. The Triton backend (``triton_backend.py``) runs the
kernels over the same pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout
from quantmla.cache.paged import read_tokens, write_tokens
from quantmla.model.spec import MLASpec
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
        """Dequantized (latent [T, d_c], k_rope [T, d_r]) fp32 of one sequence's first seq_len tokens."""
        ps = self.page_size
        p = torch.arange(seq_len, device=block_table.device)
        return read_tokens(self.pools[slot], self.layouts[slot], block_table.long()[p // ps] * ps + p % ps)

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
        write_tokens(self.pools[slot], self.layouts[slot], slot_mapping, latent, k_rope)

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
