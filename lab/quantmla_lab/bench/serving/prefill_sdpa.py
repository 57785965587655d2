"""One prefill chunk's attention: the engine's kernel against torch's SDPA backends (cuDNN, flash, efficient) and varlen_attn.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.prefill_sdpa --out $OUT/prefill/sdpa_backends_h200.json

A chunk is n queries, the last n of T positions, over T context tokens in the non-absorbed form the engine
prefills in: q_nope [n, H, d_n] and q_rope [n, H, d_r], kv [T, H, d_n + d_v] (``kv_b_proj`` of the latent),
k_rope [T, d_r]. Each candidate takes those tensors as the engine holds them and returns [n, H, d_v]; its time
includes whatever it must copy to get there (SDPA wants q and k as [H, S, d_n + d_r], and flash attention v as wide
as k). ``sdpa_cudnn_packed`` starts instead from buffers the projections could write (:func:`packed_operands`: q in
``q_b_proj``'s per-head layout, k_nope, a RoPE slot and v per head in one buffer from a ``kv_b_proj`` widened by
d_r zero rows a head) and copies only the RoPE key into its slots; ``kv_b_proj`` and ``kv_b_proj_widened`` time
the up-projection of the context's latent (d_c 512) without and with the zero rows, the widening's price.
Causal is lower-right (query i sees keys up to T - n + i). Where a backend offers no lower-right mask (cuDNN), the
chunk is two calls merged by their log-sum-exps (:func:`merge_two_parts`): the keys before the chunk
with no mask and the chunk's own keys with the top-left mask, which is lower-right there. Every output is checked
against an fp64 reference on 3 blocks of 128 queries (first, middle, last). Times are ``triton.testing.do_bench``
medians (L2 flushed between runs); TFLOP/s count 2 x (d_n + d_r + d_v) FLOPs a query, key and head over the
causal pairs only.
"""

from __future__ import annotations

import argparse

import torch

from quantmla.kernels.api import default_prefill_config, mla_prefill_attention
from quantmla.reference.prefill import prefill_attention
from quantmla_lab.bench.common import parse_fresh, record, save

BACKENDS = ("cudnn", "flash", "efficient")
NOT_ATTENTION = ("sdpa_operands", "kv_b_proj", "kv_b_proj_widened")  # rows timed beside the candidates


def causal_pairs(n: int, T: int) -> int:
    """Query-key pairs of n queries, the last n of T positions, under the lower-right causal mask."""
    return n * (T - n) + n * (n + 1) // 2


def merge_two_parts(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two key sets from each set's output o [.., n, d_v] and natural-log
    log-sum-exp of its scaled scores lse [.., n]: the outputs weighted by their share of the total mass."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse)[..., None], torch.exp(lse2 - lse)[..., None]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def sdpa_operands(q_nope, q_rope, kv, k_rope, pad_v: bool):
    """The chunk as SDPA takes it: q [1, H, n, d_n + d_r], k [1, H, T, d_n + d_r], v [1, H, T, d_v] (zero-padded
    to k's width when ``pad_v``, as flash attention needs)."""
    d_n = q_nope.shape[-1]
    T, H = kv.shape[:2]
    q = torch.cat([q_nope, q_rope], -1).transpose(0, 1)[None]
    k = torch.cat([kv[..., :d_n], k_rope[:, None, :].expand(T, H, -1)], -1).transpose(0, 1)[None]
    v = kv[..., d_n:].transpose(0, 1)[None]
    if pad_v:
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
    return q, k, v


def packed_operands(q_nope, q_rope, kv, k_rope):
    """The chunk as a projection could write it for SDPA without copies: q [n, H, d_n + d_r] (``q_b_proj``'s own
    per-head layout, RoPE applied in place) and kvr [T, H, d_n + d_r + d_v] (k_nope, the RoPE key's slot, v per head:
    ``kv_b_proj`` with d_r zero rows a head at the slot). The slot is left empty here (:func:`fill_rope_slot`)."""
    d_n = q_nope.shape[-1]
    d_r = k_rope.shape[-1]
    q = torch.cat([q_nope, q_rope], -1)
    kvr = torch.cat([kv[..., :d_n], torch.zeros(*kv.shape[:2], d_r, dtype=kv.dtype, device=kv.device), kv[..., d_n:]], -1)
    return q, kvr


def fill_rope_slot(kvr: torch.Tensor, k_rope: torch.Tensor, d_n: int) -> None:
    """Writes the shared RoPE key [T, d_r] into every head's slot of kvr (a strided copy of T x H x d_r values)."""
    kvr[:, :, d_n: d_n + k_rope.shape[-1]].copy_(k_rope[:, None, :].expand(-1, kvr.shape[1], -1))


def packed_views(q: torch.Tensor, kvr: torch.Tensor, d_n: int, d_r: int):
    """SDPA's q [1, H, n, d_n + d_r], k [1, H, T, d_n + d_r] and v [1, H, T, d_v] as views of the packed buffers."""
    return q.transpose(0, 1)[None], kvr[..., : d_n + d_r].transpose(0, 1)[None], kvr[..., d_n + d_r:].transpose(0, 1)[None]


def cudnn_two_parts(q, k, v, n: int, scale: float) -> torch.Tensor:
    """cuDNN's fused attention of n queries, the last n of T keys, under the lower-right causal mask: the chunk's own
    keys with the top-left mask and, where a context precedes them, the context's keys unmasked, merged by their
    log-sum-exps (``torch.ops.aten._scaled_dot_product_cudnn_attention`` returns them) -> [1, H, n, d_v]."""
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    T = k.shape[2]
    o2, lse2 = cudnn(q, k[:, :, T - n:], v[:, :, T - n:], None, True, 0.0, True, False, scale=scale)[:2]
    if n == T:
        return o2
    o1, lse1 = cudnn(q, k[:, :, :T - n], v[:, :, :T - n], None, True, 0.0, False, False, scale=scale)[:2]
    return merge_two_parts(o1, lse1.reshape(o1.shape[:-1]), o2, lse2.reshape(o2.shape[:-1]))


def cudnn_packed_chunk(q: torch.Tensor, kvr: torch.Tensor, k_rope: torch.Tensor, d_n: int, scale: float) -> torch.Tensor:
    """The chunk through cuDNN from the packed buffers: the RoPE key written into its slots, then the views -> [n, H,
    d_v]; the only copy is the slot's."""
    fill_rope_slot(kvr, k_rope, d_n)
    qv, k, v = packed_views(q, kvr, d_n, k_rope.shape[-1])
    return cudnn_two_parts(qv, k, v, q.shape[0], scale)[0].transpose(0, 1)


def sdpa_chunk(backend: str, q_nope, q_rope, kv, k_rope, scale: float) -> torch.Tensor:
    """The chunk's attention through one SDPA backend -> [n, H, d_v]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    n, T, d_v = q_nope.shape[0], kv.shape[0], kv.shape[-1] - q_nope.shape[-1]
    q, k, v = sdpa_operands(q_nope, q_rope, kv, k_rope, pad_v=backend == "flash")
    if backend == "cudnn":
        o = cudnn_two_parts(q, k, v, n, scale)
    else:
        sdp = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
        with sdpa_kernel(sdp):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, T),
                                                                 scale=scale)
    return o[0, :, :, :d_v].transpose(0, 1)


def varlen_chunk(q_nope, q_rope, kv, k_rope, scale: float) -> torch.Tensor:
    """The chunk through ``torch.nn.attention.varlen.varlen_attn`` (flash attention; causal there is lower-right,
    and its tokens-first layout is the engine's: no transposes; v zero-padded to k's width) -> [n, H, d_v]."""
    from torch.nn.attention.varlen import varlen_attn

    n, d_n, (T, H) = q_nope.shape[0], q_nope.shape[-1], kv.shape[:2]
    d_v = kv.shape[-1] - d_n
    q = torch.cat([q_nope, q_rope], -1)
    k = torch.cat([kv[..., :d_n], k_rope[:, None, :].expand(T, H, -1)], -1)
    v = torch.nn.functional.pad(kv[..., d_n:], (0, k.shape[-1] - d_v))
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, T], dtype=torch.int32, device=q.device)
    import inspect

    # torch 2.11 names causal attention is_causal; later versions take it as the window (-1, 0)
    causal = {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else {"window_size": (-1, 0)}
    o = varlen_attn(q, k, v, cu_q, cu_k, n, T, scale=scale, **causal)
    return o[..., :d_v]


def reference_rows(q_nope, q_rope, kv, k_rope, scale: float, rows: torch.Tensor) -> torch.Tensor:
    """fp64 attention of the chunk's queries ``rows`` (ascending) -> [len(rows), H, d_v]: the library's oracle
    (``reference.prefill.prefill_attention``) on each run of consecutive rows, as the last queries of the context
    that ends with them."""
    n, T = q_nope.shape[0], kv.shape[0]
    r = rows.tolist()
    runs, start = [], 0
    for i in range(1, len(r) + 1):
        if i == len(r) or r[i] != r[i - 1] + 1:
            runs.append((r[start], r[i - 1] + 1))
            start = i
    out = []
    for a, b in runs:
        end = T - n + b  # the context the queries a..b-1 see ends at the last one's position
        out.append(prefill_attention(q_nope[a:b], q_rope[a:b], kv[:end], k_rope[:end], scale, torch.float64))
    return torch.cat(out)


def chunk_tensors(n: int, T: int, H: int, d_n: int, d_r: int, d_v: int, device: str, seed: int = 0):
    """Random bf16 operands of one chunk as the engine holds them (kv a contiguous [T, H, d_n + d_v])."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=g).bfloat16()
    return r(n, H, d_n), r(n, H, d_r), r(T, H, d_n + d_v), r(T, d_r)


def measure(shapes, H=16, d_n=128, d_r=64, d_v=128, backends=BACKENDS, device="cuda") -> list[dict]:
    from triton.testing import do_bench

    scale = (d_n + d_r) ** -0.5
    rows = []
    for n, T in shapes:
        q_nope, q_rope, kv, k_rope = chunk_tensors(n, T, H, d_n, d_r, d_v, device)
        check = torch.cat([torch.arange(0, min(128, n)), torch.arange(n // 2, min(n, n // 2 + 128)),
                           torch.arange(max(0, n - 128), n)]).unique().to(device)
        ref = reference_rows(q_nope, q_rope, kv, k_rope, scale, check)
        flop = 2 * causal_pairs(n, T) * H * (d_n + d_r + d_v)
        cands = {"kernel": lambda: mla_prefill_attention(q_nope, q_rope, kv, k_rope, scale)}
        for b in backends:
            cands[f"sdpa_{b}"] = lambda b=b: sdpa_chunk(b, q_nope, q_rope, kv, k_rope, scale)
        cands["varlen_attn"] = lambda: varlen_chunk(q_nope, q_rope, kv, k_rope, scale)
        cands["sdpa_operands"] = lambda: sdpa_operands(q_nope, q_rope, kv, k_rope, pad_v=False)
        if "cudnn" in backends:  # from buffers the projections could write: the RoPE slot's copy and nothing else
            qp, kvr = packed_operands(q_nope, q_rope, kv, k_rope)
            cands["sdpa_cudnn_packed"] = lambda qp=qp, kvr=kvr: cudnn_packed_chunk(qp, kvr, k_rope, d_n, scale)
        # what kv_b_proj's d_r zero rows a head cost: the up-projection of the context's latent, as is and widened
        lat = torch.randn(T, 512, device=device).bfloat16()
        w = torch.randn(H * (d_n + d_v), 512, device=device).bfloat16()
        w_wide = torch.randn(H * (d_n + d_r + d_v), 512, device=device).bfloat16()
        cands["kv_b_proj"] = lambda lat=lat, w=w: lat @ w.t()
        cands["kv_b_proj_widened"] = lambda lat=lat, w=w_wide: lat @ w.t()
        row = {"n": n, "T": T, "heads": H, "tflop": flop / 1e12,
               "kernel_config": default_prefill_config(n, T).describe(), "candidates": {}}
        for name, fn in cands.items():
            try:
                out = fn()
                c = {}
                attends = name not in NOT_ATTENTION
                if attends:
                    err = (out[check].double() - ref).norm() / ref.norm()
                    c["rel_err_fp64"] = float(err)
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                c["ms"] = ms
                if attends:  # the operands' copies and the up-projections alone do no attention
                    c["tflops"] = flop / ms / 1e9
            except Exception as e:  # a backend that refuses the shape: recorded, not fatal
                c = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            row["candidates"][name] = c
            print(f"{n:>6} of {T:<6} {name:<14} " + (f"{c['ms']:.3f} ms  {c.get('tflops', 0):.0f} TFLOP/s"
                  + (f"  err {c['rel_err_fp64']:.2e}" if "rel_err_fp64" in c else "") if "ms" in c else c["error"]),
                  flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", type=lambda x: tuple(int(v) for v in x.split("x")),
                   default=[(16384, 16384), (4096, 20480), (8192, 8192), (2048, 18432), (4096, 4096), (1536, 1536)],
                   help="chunks as NxT: n queries over T context tokens")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    rows = measure(a.shapes, backends=a.backends)
    save(record(cudnn=torch.backends.cudnn.version(), chunks=rows), a.out)


if __name__ == "__main__":
    main()
