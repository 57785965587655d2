"""An eager step's inputs: its decode rows and prompt chunks (any mix) flattened into one forward's token ids,
positions and attention metadata, decode rows first. Every index array goes to the device in one host-to-device
copy each; the chunks' context slots in one array that every layer reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quantmla.cache.paged import slot_of
from quantmla.serving.backends import AttnMeta, PrefillChunk


@dataclass
class EagerInputs:
    """ids, pos: int64 [N] token ids and positions (decode rows, then each chunk's tokens); meta: the step's attention
    metadata; rows: the flat rows whose logits are sampled; row_of: plan item index -> its place in ``rows``."""

    ids: torch.Tensor
    pos: torch.Tensor
    meta: AttnMeta
    rows: list[int]
    row_of: dict[int, int]


def eager_inputs(items, page_size: int, device: torch.device, stage=None) -> EagerInputs:
    """The inputs of one eager forward over `items` (``ScheduledSeq``: n == 1 a decode row, n > 1 a prompt chunk);
    `stage`: the engine's RoPE stage rows (``StageRows``) where a RoPE path is grouped per page, else None."""
    ps = page_size
    dec = [k for k, it in enumerate(items) if it.n == 1]
    pre = [k for k, it in enumerate(items) if it.n > 1]
    order = dec + pre
    ids, pos, slots = [], [], []
    for k in order:
        it = items[k]
        p = np.arange(it.start, it.start + it.n)
        ids.append(np.asarray(it.seq.tokens[it.start: it.start + it.n], dtype=np.int64))
        pos.append(p)
        slots.append(slot_of(it.seq.pages, p, ps))
    dev = device
    meta = AttnMeta(slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev), num_decode=len(dec))
    if stage is not None:
        srows = np.concatenate([np.full(items[k].n, stage.row(items[k].seq), dtype=np.int32) for k in order])
        meta.stage_rows = torch.from_numpy(srows).to(dev)
    if dec:
        width = max(len(items[k].seq.pages) for k in dec)
        bt = np.zeros((len(dec), width), dtype=np.int32)
        for j, k in enumerate(dec):
            pg = items[k].seq.pages
            bt[j, : len(pg)] = pg
        lens = [items[k].start + 1 for k in dec]
        meta.block_tables = torch.from_numpy(bt).to(dev)
        meta.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        meta.max_seq_len = max(lens)
    flat = len(dec)
    rows, row_of = [], {}
    for j, k in enumerate(dec):
        if items[k].sample:
            row_of[k] = len(rows)
            rows.append(j)
    if pre:  # every chunk's context slots, one host-to-device copy per step (read by every layer)
        ctx = [slot_of(items[k].seq.pages, np.arange(items[k].start + items[k].n), ps) for k in pre]
        ctx_t = torch.from_numpy(np.concatenate(ctx)).to(dev)
    off = 0
    for k in pre:
        it = items[k]
        T = it.start + it.n
        npg = -(-T // ps)
        meta.chunks.append(PrefillChunk(flat, it.n, T, torch.tensor(it.seq.pages[:npg], dtype=torch.int32, device=dev),
                                        npg, slots=ctx_t[off: off + T]))
        off += T
        if it.sample:
            row_of[k] = len(rows)
            rows.append(flat + it.n - 1)
        flat += it.n
    ids_t = torch.from_numpy(np.concatenate(ids)).to(dev)
    pos_t = torch.from_numpy(np.concatenate(pos)).to(dev)
    return EagerInputs(ids_t, pos_t, meta, rows, row_of)
