"""The external BF16 MLA decode kernel that ``quantmla bench-kernel --peer FILE`` times beside ours: the file is
loaded from a path given on the command line (never part of this repository), and the benchmark's tokens are
handed to it in the token-interleaved BF16 layout it reads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from quantmla.cache.paged import gather_sequences
from quantmla.kernels import api, schedule

D_C, D_R, PAGE, DEV = 512, 64, 64, "cuda"


def load_peer(path: str):
    """An external BF16 MLA decode kernel file: vLLM / SGLang ``decode_attention_fwd`` (paged,
    q [B, H, 576], k [pages, page, 1, 576]) or any file defining ``quantmla_peer_decode(q_latent,
    q_rope, kv [pages, page, 576] bf16, block_table, seq_lens, scale) -> out``. Returns a callable
    (q_latent [B,H,dc], q_rope, kv, block_table, seq_lens, scale) -> run() closure factory."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"peer kernel file {path} not found")
    if "vllm.platforms" not in sys.modules:  # the vLLM copy imports its platform probe
        import types

        plat = types.ModuleType("vllm.platforms")
        plat.current_platform = types.SimpleNamespace(is_rocm=lambda: False, is_cuda=lambda: True)
        sys.modules.setdefault("vllm", types.ModuleType("vllm"))
        sys.modules["vllm.platforms"] = plat
    spec = importlib.util.spec_from_file_location("quantmla_peer_kernel", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if hasattr(mod, "quantmla_peer_decode"):
        def make(qc, qr, kv, bt, sl, scale):
            return lambda: mod.quantmla_peer_decode(qc, qr, kv, bt, sl, scale)
        return make, "quantmla_peer_decode"
    if hasattr(mod, "decode_attention_fwd"):
        def make(qc, qr, kv, bt, sl, scale, num_kv_splits=None):
            B, H, dc = qc.shape
            q = torch.cat([qc, qr], dim=-1).contiguous()  # [B, H, 576]
            k = kv.unsqueeze(2)  # [pages, page, 1, 576]
            v = k[..., :dc]
            o = torch.empty(B, H, dc, dtype=qc.dtype, device=qc.device)
            n = num_kv_splits or max(1, min(64, (2 * schedule.num_sms_of(torch.device(qc.device))) // max(1, B)))
            logits = torch.empty(B, H, n, dc + 1, dtype=torch.float32, device=qc.device)
            page = kv.shape[1]
            run = lambda: mod.decode_attention_fwd(q, k, v, o, bt, sl, logits, n, scale, page)  # noqa: E731
            run.out = o
            return run
        return make, "decode_attention_fwd"
    raise api.QuantMLAError(f"{path} defines neither quantmla_peer_decode nor decode_attention_fwd")


def peer_indexes(batch: int, heads: int, num_kv_splits: int, d_c: int = D_C) -> bool:
    """Whether the vLLM / SGLang decode can address its split partials [batch, heads, splits, d_c + 1] (fp32): it
    forms their offsets in int32, so a tensor of 2**31 elements or more makes it read and write out of bounds
    (an illegal address that ends the process's CUDA context)."""
    return batch * heads * num_kv_splits * (d_c + 1) < 2**31


def peer_kv(cache) -> torch.Tensor:
    """The same (dequantized BF16) tokens of a benchmark cache (decode_speed.Cache) in the token-interleaved
    [pages, page, d_c + d_r] layout peers take."""
    lat, kr = gather_sequences(cache.pages, cache.layout, cache.block_table, cache.seq_lens)
    n_pages = cache.pages.shape[0]
    kv = torch.zeros(n_pages, PAGE, D_C + D_R, dtype=torch.bfloat16, device=DEV)
    for b, n in enumerate(cache.lens):
        pos = torch.arange(n, device=DEV)
        pg = cache.block_table[b].long()[pos // PAGE]
        kv[pg, pos % PAGE] = torch.cat([lat[b, :n], kr[b, :n]], -1).to(torch.bfloat16)
    return kv


# --------------------------------------------------------------------------------------------------
