"""The paged cache pool and a pure-torch reference writer/reader of the page layout.

The byte layout itself lives in :mod:`quantmla.cache.layout` (``PageLayout``); this module only
*uses* it. A pool holds one ``uint8`` tensor ``[layers, num_pages, page_bytes]``; a page stores
``page_size`` consecutive tokens of one sequence in one layer, as the four sections of the layout.
Sequences own lists of pages (a free list hands them out); a *block table* ``[B, max_pages]`` int32
maps a sequence's page index ``pos // page_size`` to the physical page, and a *slot* is
``page * page_size + pos % page_size``.

The reference writer (``write_tokens``) quantizes with :func:`quantmla.quant.quantize` and stores
the packed codes and metadata bytes exactly where the layout says; the Triton append kernel must
produce the same bytes. The reference reader (``read_tokens``, ``gather_sequences``) dequantizes
them back; tests and the CPU fallback of the decode API use it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from quantmla.cache.layout import CacheFormat, PageLayout, TokenLayout, compression
from quantmla.errors import QuantMLAError
from quantmla.quant.format import PathFormat
from quantmla.quant.groupwise import Quantized, dequantize, quantize, quantize_page

__all__ = [
    "OutOfPagesError",
    "NULL_PAGE",
    "PageAllocator",
    "PagePool",
    "slot_of",
    "slots_for",
    "encode_tokens",
    "encode_page_rope",
    "decode_fields",
    "write_tokens",
    "write_tokens_staged",
    "read_fields",
    "read_tokens",
    "gather_sequences",
    "compression_report",
]


class OutOfPagesError(QuantMLAError):
    """The page pool has no free page left for a sequence that grows."""


# --------------------------------------------------------------------------------------------------
# The pool: the cache memory, the free list, slot addressing, block tables, allocated bytes
# --------------------------------------------------------------------------------------------------
NULL_PAGE = 0
"""In a pool made with ``null_page=True`` (the serving engine's), page 0 of every layer is never
handed out: the padded rows of a fixed-shape (CUDA-graph) step write and read it harmlessly."""


def slot_of(pages, positions, page_size: int):
    """Slots ``page * page_size + offset`` of token `positions` of a sequence that owns `pages` (its
    page ids in order). numpy arrays, torch tensors (int64) or Python ints alike; one int position of a
    page list stays on Python ints (a decode step's rows: no array built from a long page list)."""
    if isinstance(positions, int) and isinstance(pages, list):
        return pages[positions // page_size] * page_size + positions % page_size
    if isinstance(pages, list):
        pages = torch.tensor(pages, dtype=torch.int64) if isinstance(positions, torch.Tensor) else np.asarray(pages, np.int64)
    return pages[positions // page_size] * page_size + positions % page_size


def slots_for(block_table: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slots (int64) of tokens at `positions` of the block-table rows `seq_idx`."""
    seq_idx = seq_idx.to(block_table.device, torch.int64)
    positions = positions.to(block_table.device, torch.int64)
    return block_table.long()[seq_idx, positions // page_size] * page_size + positions % page_size


class PageAllocator:
    """The free list of page ids ``first .. first + num_pages - 1`` (``first = 1`` keeps the null page out)."""

    def __init__(self, num_pages: int, first: int = 0):
        self.num_pages = num_pages
        self._free = list(range(first + num_pages - 1, first - 1, -1))  # a stack: pop() gives low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} of {self.num_pages} are free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class PagePool:
    """The paged cache memory of every cache slot (layer) and the free list their page ids share.

    ``layouts`` maps each slot to its ``PageLayout`` (one layout with ``layers`` gives slots 0 ..
    layers - 1); formats may differ per slot, page ids do not: a sequence's page p is page p of every
    slot. The memory is one ``uint8`` allocation; ``layer(slot)`` is that slot's ``[pages, page_bytes]``
    view the kernels take, and ``data`` the ``[layers, pages, page_bytes]`` view when every slot has
    one layout. ``null_page=True`` adds page 0 (``NULL_PAGE``) in front, never handed out. Sequences
    (any hashable id) own lists of pages through ``append_slots`` / ``free``; the serving scheduler,
    which keeps pages on its own sequences, takes ``allocator()`` instead.
    """

    def __init__(self, layouts: PageLayout | dict[Hashable, PageLayout], num_pages: int, layers: int = 1,
                 device: str | torch.device = "cpu", null_page: bool = False):
        if isinstance(layouts, PageLayout):
            layouts = {i: layouts for i in range(layers)}
        if num_pages < 1 or not layouts:
            raise QuantMLAError(f"a page pool needs at least one page and one layer, got {num_pages} pages, {len(layouts)} layers")
        self.layouts = dict(layouts)
        self.first_page = 1 if null_page else 0
        rows = num_pages + self.first_page
        sizes = {s: rows * lay.page_bytes for s, lay in self.layouts.items()}
        self.buffer = torch.zeros(sum(sizes.values()), dtype=torch.uint8, device=device)
        self._views, off = {}, 0
        for s, lay in self.layouts.items():
            self._views[s] = self.buffer[off: off + sizes[s]].view(rows, lay.page_bytes)
            off += sizes[s]
        self._num_pages = num_pages
        self._alloc = PageAllocator(num_pages, self.first_page)
        self._pages: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    # -- memory ---------------------------------------------------------------------------------------
    @property
    def layout(self) -> PageLayout:
        """The one layout of a uniform pool."""
        lays = set(self.layouts.values())
        if len(lays) != 1:
            raise QuantMLAError("this pool's slots have different layouts; use pool.layouts[slot]")
        return next(iter(lays))

    @property
    def data(self) -> torch.Tensor:
        """uint8 [layers, pages, page_bytes] of a uniform pool (page 0 the null page if it has one)."""
        return self.buffer.view(len(self.layouts), -1, self.layout.page_bytes)

    def layer(self, slot: Hashable = 0) -> torch.Tensor:
        return self._views[slot]

    # -- sizes ----------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages sequences can own (the null page not counted)."""
        return self._num_pages

    @property
    def layers(self) -> int:
        return len(self.layouts)

    @property
    def page_size(self) -> int:
        return next(iter(self.layouts.values())).page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page id over every slot."""
        return sum(lay.page_bytes for lay in self.layouts.values())

    @property
    def free_pages(self) -> int:
        return self._alloc.free

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._alloc.free

    def allocator(self, num_pages: int | None = None) -> PageAllocator:
        """A fresh free list over this pool's first `num_pages` usable pages (all of them by default),
        for a scheduler that keeps its sequences' pages itself."""
        n = self.num_pages if num_pages is None else num_pages
        if not 1 <= n <= self.num_pages:
            raise QuantMLAError(f"a budget of {n} pages does not fit this pool's {self.num_pages}")
        return PageAllocator(n, self.first_page)

    # -- sequences ------------------------------------------------------------------------------------
    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._pages

    @property
    def sequences(self) -> list[Hashable]:
        return list(self._pages)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[seq_id]

    def pages_of(self, seq_id: Hashable) -> list[int]:
        return list(self._pages[seq_id])

    def reserve(self, seq_id: Hashable, num_tokens: int) -> None:
        """Make sure `seq_id` has pages for `num_tokens` tokens in total (its length is unchanged). Where the pool
        has too few free pages nothing changes: a new sequence is not added."""
        pages = self._pages.get(seq_id, [])
        need = -(-num_tokens // self.page_size) - len(pages)
        if need > self._alloc.free:
            raise OutOfPagesError(
                f"sequence {seq_id!r} needs {need} more pages for {num_tokens} tokens but only "
                f"{self._alloc.free} of {self.num_pages} are free; free finished sequences or make a larger pool"
            )
        self._pages[seq_id] = pages
        self._lens.setdefault(seq_id, 0)
        if need > 0:
            pages += self._alloc.allocate(need)

    def append_slots(self, seq_id: Hashable, n: int) -> torch.Tensor:
        """Grow `seq_id` by `n` tokens (allocating pages) and return their slots, int64 [n]."""
        start = self._lens.get(seq_id, 0)
        self.reserve(seq_id, start + n)
        self._lens[seq_id] = start + n
        return slot_of(self._pages[seq_id], torch.arange(start, start + n, dtype=torch.int64), self.page_size)

    def free(self, seq_id: Hashable) -> None:
        """Return the pages of `seq_id` to the free list (the bytes are left as they are)."""
        self._alloc.release(self._pages.pop(seq_id))
        self._lens.pop(seq_id, None)

    def block_table(self, seq_ids: Sequence[Hashable], width: int | None = None, device=None) -> torch.Tensor:
        """int32 [B, width] physical pages of each sequence; unused entries are 0 (never read; the null
        page where the pool has one)."""
        rows = [self._pages[s] for s in seq_ids]
        width = max([len(r) for r in rows] + [1]) if width is None else width
        bt = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, r in enumerate(rows):
            if len(r) > width:
                raise QuantMLAError(f"sequence {seq_ids[i]!r} has {len(r)} pages, more than the table width {width}")
            bt[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return bt.to(device or self.buffer.device)

    def seq_lens(self, seq_ids: Sequence[Hashable], device=None) -> torch.Tensor:
        return torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32, device=device or self.buffer.device)

    # -- accounting -----------------------------------------------------------------------------------
    def allocated_bytes(self, block_table_entry_bytes: int = 4) -> int:
        """Bytes the live sequences hold: their pages in every layer, block-table entries and lengths.

        Equals ``layout.allocated_bytes([lengths...], layers)`` (the one definition in layout.py)
        when every sequence holds exactly the pages its length needs.
        """
        pages = sum(len(p) for p in self._pages.values())
        return pages * self.page_bytes + pages * block_table_entry_bytes + 4 * len(self._pages)

    def pool_bytes(self) -> int:
        """Bytes of the whole pool (allocated up front on the device)."""
        return self.buffer.numel()


# --------------------------------------------------------------------------------------------------
# Reference writer / reader (pure torch)
# --------------------------------------------------------------------------------------------------
def _encode_path(x: torch.Tensor, fmt: PathFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (codes bytes uint8 [T, code_bytes], meta bytes uint8 [T, meta_bytes])."""
    T = x.shape[0]
    if not fmt.quantized:
        raw = x.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(T, -1)
        return raw, torch.empty((T, 0), dtype=torch.uint8, device=x.device)
    q = quantize(x, fmt)
    meta = q.meta.to(fmt.torch_meta_dtype).contiguous().view(torch.uint8).reshape(T, -1)
    return q.codes.reshape(T, -1), meta


def _decode_path(codes: torch.Tensor, meta: torch.Tensor, fmt: PathFormat, dim: int) -> torch.Tensor:
    T = codes.shape[0]
    if not fmt.quantized:
        return codes.contiguous().view(torch.bfloat16).reshape(T, dim).float()
    m = meta.contiguous().view(fmt.torch_meta_dtype).reshape(T, fmt.groups(dim), fmt.meta_fields)
    return dequantize(Quantized(codes, m), fmt, dim)


def encode_tokens(layout: PageLayout | TokenLayout, latent: torch.Tensor, k_rope: torch.Tensor) -> dict[str, torch.Tensor]:
    """The record bytes of tokens: section name -> uint8 [T, field_bytes]. A RoPE path grouped per
    page has no per-token record of its own (its codes depend on the page): see :func:`encode_page_rope`."""
    tok = layout.token if isinstance(layout, PageLayout) else layout
    fmt: CacheFormat = tok.fmt
    cc, cm = _encode_path(latent.reshape(-1, tok.d_c), fmt.content)
    out = {"content_codes": cc, "content_meta": cm}
    if not fmt.rope.per_page:
        out["rope_codes"], out["rope_meta"] = _encode_path(k_rope.reshape(-1, tok.d_r), fmt.rope)
    return out


def encode_page_rope(layout: PageLayout | TokenLayout, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE bytes of one page grouped per page, from its first n tokens' keys k_rope [n, d_r]:
    (codes uint8 [n, rope code bytes], page metadata uint8 [sets · set bytes]): the metadata sets of the
    blocks holding tokens, ceil(n / block) of them (one for block 0), in the section's order."""
    tok = layout.token if isinstance(layout, PageLayout) else layout
    q = quantize_page(k_rope.reshape(-1, tok.d_r), tok.fmt.rope)
    return q.codes, q.meta.contiguous().view(torch.uint8).reshape(-1)


def decode_fields(layout: PageLayout | TokenLayout, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_tokens`: -> latent [T, d_c], k_rope [T, d_r] in fp32 (dequantized).
    A RoPE path grouped per page reads each token's metadata set from ``fields["rope_page_meta"]``
    ([T, set bytes]: the set of the token's block, as :func:`read_fields` gathers it)."""
    tok = layout.token if isinstance(layout, PageLayout) else layout
    c = _decode_path(fields["content_codes"], fields["content_meta"], tok.fmt.content, tok.d_c)
    rope_meta = fields["rope_page_meta"] if tok.fmt.rope.per_page else fields["rope_meta"]
    r = _decode_path(fields["rope_codes"], rope_meta, tok.fmt.rope, tok.d_r)
    return c, r


def _byte_index(layout: PageLayout, section: str, slots: torch.Tensor) -> torch.Tensor:
    """Flat byte offsets [T, field_bytes] of `section` of the tokens at `slots` in a [num_pages, page_bytes] pool."""
    fb = layout.token.field_bytes[section]
    slots = slots.to(torch.int64)
    page, off = slots // layout.page_size, slots % layout.page_size
    base = page * layout.page_bytes + layout.offsets[section] + off * fb
    return base[:, None] + torch.arange(fb, device=slots.device, dtype=torch.int64)[None, :]


def _check_pages(pages: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != layout.page_bytes:
        raise QuantMLAError(
            f"expected one layer's pages as uint8 [num_pages, {layout.page_bytes}], got {pages.dtype} {tuple(pages.shape)}"
        )
    if not pages.is_contiguous():
        raise QuantMLAError("the page tensor must be contiguous")
    return pages.view(-1)


def write_tokens(pages: torch.Tensor, layout: PageLayout, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                 page_rope: dict[int, torch.Tensor] | None = None) -> None:
    """Quantize tokens and store their records at `slots` (int [T]; negative slots are skipped).

    pages: uint8 [num_pages, page_bytes] (one layer); latent [T, d_c], k_rope [T, d_r] (any float dtype).

    A RoPE path grouped per page is quantized over each page's tokens: `page_rope` maps every page the
    slots touch to the full-precision keys of its first n tokens [n, d_r] (the new ones included; an
    unfinished page is quantized over the tokens it holds), and the page's RoPE codes and metadata are
    rewritten from them: each block's metadata set over the block's tokens (the unfinished last block
    over those it holds), the sets of blocks without tokens left as they are. `k_rope` is not used then.
    """
    flat = _check_pages(pages, layout)
    slots = slots.reshape(-1).to(pages.device, torch.int64)
    keep = slots >= 0
    latent = latent.reshape(-1, layout.token.d_c).to(pages.device)[keep]
    k_rope = k_rope.reshape(-1, layout.token.d_r).to(pages.device)[keep]
    slots = slots[keep]
    per_page = layout.token.fmt.rope.per_page
    if per_page:
        _check_page_rope(layout, slots, page_rope)
    if slots.numel() == 0:
        return
    for name, data in encode_tokens(layout, latent, k_rope).items():
        if data.shape[1]:
            flat[_byte_index(layout, name, slots)] = data
    if per_page:
        for page in sorted({int(p) for p in (slots // layout.page_size).tolist()}):
            keys = page_rope[page].to(pages.device)
            codes, meta = encode_page_rope(layout, keys)
            own = page * layout.page_size + torch.arange(keys.shape[0], device=pages.device)
            flat[_byte_index(layout, "rope_codes", own)] = codes
            start = page * layout.page_bytes + layout.offsets["rope_page_meta"]
            flat[start: start + meta.numel()] = meta


def _check_page_rope(layout: PageLayout, slots: torch.Tensor, page_rope) -> None:
    """Every page the slots write is in `page_rope`, with keys for at least the written offsets."""
    if page_rope is None:
        raise QuantMLAError(
            f"the RoPE path {layout.token.fmt.rope.describe()} is grouped per page: pass page_rope, the "
            "full-precision keys of each written page's tokens so far, to quantize the page over them")
    need: dict[int, int] = {}
    for s in slots.tolist():
        p, o = divmod(int(s), layout.page_size)
        need[p] = max(need.get(p, 0), o + 1)
    for p, n in need.items():
        keys = page_rope.get(p)
        if keys is None or keys.dim() != 2 or keys.shape[1] != layout.token.d_r:
            raise QuantMLAError(f"page_rope has no [n, {layout.token.d_r}] keys for page {p}, which these slots write")
        if not n <= keys.shape[0] <= layout.page_size:
            raise QuantMLAError(
                f"page_rope[{p}] holds {keys.shape[0]} tokens; the slots write offset {n - 1} of that page "
                f"(it needs between {n} and {layout.page_size} tokens)")


def write_tokens_staged(pages: torch.Tensor, layout: PageLayout, slots: torch.Tensor, latent: torch.Tensor,
                        k_rope: torch.Tensor, rope_stage: torch.Tensor, stage_rows: torch.Tensor) -> None:
    """``write_tokens`` for a RoPE path grouped per page, with the keys of earlier calls in a stage:
    rope_stage [S, page_size, d_r] holds, in each sequence's row, the keys of the page it is filling;
    stage_rows [T] is each token's row. Each page the call writes is quantized over its keys (the stage's
    earlier ones, this call's new ones), then the new keys of the pages left unfinished are staged for the
    next call. A page's tokens come in position order; the append kernels do the same on the GPU."""
    slots = slots.reshape(-1).to(torch.int64)
    rows = stage_rows.reshape(-1).to(torch.int64)
    ps = layout.page_size
    new: dict[int, dict[int, int]] = {}  # page -> {offset: token index}
    row_of = {}
    for i, (s, r) in enumerate(zip(slots.tolist(), rows.tolist())):
        if s >= 0:
            new.setdefault(s // ps, {})[s % ps] = i
            row_of[s // ps] = r
    page_rope = {}
    for p, toks in new.items():
        n = max(toks) + 1
        keys = rope_stage[row_of[p], :n].float().clone()  # the stage row changes only below
        for off, i in toks.items():
            keys[off] = k_rope[i].float()
        page_rope[p] = keys
    write_tokens(pages, layout, slots, latent, k_rope, page_rope=page_rope)
    for p, toks in new.items():
        if max(toks) + 1 < ps:  # left unfinished: its keys are the next call's
            for off, i in toks.items():
                rope_stage[row_of[p], off] = k_rope[i].to(rope_stage.dtype)


def read_fields(pages: torch.Tensor, layout: PageLayout, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """The raw record bytes of tokens at `slots`: section -> uint8 [T, field_bytes]; a RoPE path grouped per
    page adds ``rope_page_meta``, each token's metadata set (its block's), uint8 [T, set bytes]."""
    flat = _check_pages(pages, layout)
    slots = slots.reshape(-1).to(pages.device, torch.int64)
    out = {name: flat[_byte_index(layout, name, slots)] for name in layout.token.field_bytes}
    if layout.rope_meta_block:
        nb = layout.token.fmt.rope.set_meta_bytes(layout.token.d_r)
        page, off = slots // layout.page_size, slots % layout.page_size
        base = page * layout.page_bytes + layout.offsets["rope_page_meta"] + off // layout.rope_meta_block * nb
        out["rope_page_meta"] = flat[base[:, None] + torch.arange(nb, device=slots.device, dtype=torch.int64)[None, :]]
    return out


def read_tokens(pages: torch.Tensor, layout: PageLayout, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized latent [T, d_c] and k_rope [T, d_r] (fp32) of the tokens at `slots`."""
    return decode_fields(layout, read_fields(pages, layout, slots))


def gather_sequences(
    pages: torch.Tensor, layout: PageLayout, block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized latent [B, T, d_c] and k_rope [B, T, d_r] (fp32) of whole sequences; zeros past each length."""
    lens = [int(n) for n in seq_lens.tolist()]
    B = len(lens)
    T = max(lens + [1]) if max_len is None else max_len
    dev = pages.device
    pos = torch.arange(T, device=dev, dtype=torch.int64)
    valid = pos[None, :] < torch.tensor(lens, device=dev)[:, None]  # [B, T]
    b_idx = torch.arange(B, device=dev)[:, None].expand(B, T)
    bt = block_table.to(dev).long()
    page_idx = torch.where(valid, pos[None, :] // layout.page_size, torch.zeros_like(pos)[None, :])
    slots = bt[b_idx, page_idx] * layout.page_size + pos[None, :] % layout.page_size
    c = torch.zeros(B, T, layout.token.d_c, device=dev)
    r = torch.zeros(B, T, layout.token.d_r, device=dev)
    if valid.any():
        cv, rv = read_tokens(pages, layout, slots[valid])
        c[valid], r[valid] = cv, rv
    return c, r


def compression_report(
    d_c: int, d_r: int, fmt: CacheFormat, tokens: Sequence[int] = (4096, 32768, 131072), page_size: int = 64
) -> list[dict]:
    """One row per sequence length in `tokens`: `fmt`'s bytes per token and per page, the bytes one
    sequence allocates (pages + block tables, ``PageLayout.allocated_bytes``) in `fmt` and in BF16, and
    their ratio (:func:`quantmla.cache.layout.compression`)."""
    ref = PageLayout(TokenLayout(d_c, d_r, CacheFormat()), page_size)
    got = PageLayout(TokenLayout(d_c, d_r, fmt), page_size)
    return [{"format": fmt.describe(), "tokens": n, "bytes_per_token": got.token.bytes_per_token,
             "page_bytes": got.page_bytes, "allocated_bytes": got.allocated_bytes(n),
             "bf16_allocated_bytes": ref.allocated_bytes(n), "compression": compression(d_c, d_r, fmt, n, page_size)}
            for n in tokens]
