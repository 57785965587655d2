"""Rows of the RoPE stage: where each running sequence keeps the full-precision RoPE keys of the page it fills.

A cache slot whose RoPE path is grouped per page (``PathFormat(grouping="page")``: one scale and zero point
per channel over a page's tokens) requantizes a page over its tokens as it fills, so the keys of its tokens
so far must be kept until the page is full. The backend owns that memory (``AttentionBackend.rope_stage``,
fp32 ``[rows, page_size, d_r]`` per slot); this module decides which row each sequence uses. Row 0 is the
null row, which padded batch rows write (as they write the null page).
"""

from __future__ import annotations

from quantmla.errors import QuantMLAError
from quantmla.quant.format import PathFormat


def page_grouped(fmt: PathFormat, block: int = 0) -> PathFormat:
    """The per-page form of an integer RoPE format: the same bits, mode and metadata dtype, one scale and
    zero point per channel of each page, or of each block of `block` tokens inside it (0: the whole page;
    ``PathFormat.block``; the evaluation's ``RopeChannelFormat(page_size=block)``)."""
    from dataclasses import replace

    from quantmla.cache.rope_channel import RopeChannelFormat

    if not fmt.quantized or fmt.mode not in ("affine", "symmetric"):
        raise QuantMLAError(f"RoPE keys per channel per page take integer codes; the RoPE path is {fmt.describe()}")
    return replace(RopeChannelFormat(fmt.bits, mode=fmt.mode, meta_dtype=fmt.meta_dtype).path_format, block=block)


class StageRows:
    """Stage rows of the running sequences: handed out when a sequence first runs, given back when it leaves
    the running set (finished, failed or preempted; a preempted sequence recomputes its pages from the
    start, so a new row serves it). ``rows`` counts the null row."""

    def __init__(self, rows: int):
        self._free = list(range(rows - 1, 0, -1))  # a stack: low rows first
        self._of: dict[int, int] = {}  # Sequence.index -> row

    def update(self, running) -> None:
        """Rows for exactly the sequences in `running` (Sequence objects)."""
        live = {s.index for s in running}
        for k in [k for k in self._of if k not in live]:
            self._free.append(self._of.pop(k))
        for s in running:
            if s.index not in self._of:
                if not self._free:
                    raise QuantMLAError("more running sequences than RoPE stage rows (EngineConfig.max_num_seqs)")
                self._of[s.index] = self._free.pop()

    def row(self, seq) -> int:
        return self._of[seq.index]
