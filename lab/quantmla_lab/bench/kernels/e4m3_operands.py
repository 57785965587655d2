"""What 8-bit products would cost in accuracy: the decode arithmetic of the tokens-as-M kernel emulated on the
CPU with its query and probabilities as sums of e4m3 or s8 terms (the 2- and 4-bit codes are exact in both), against
fp64 attention over the same dequantized cache.

One layer, one sequence, H query rows, T cached tokens of an INT4/INT4 (or INT2/INT4) cache with per-token
groups (content 128, RoPE 64 channels; fp16 scale and zero point), d_c 512, d_r 64. The kernels' arithmetic:

    scores  s(t) = Σ_g scale_g(t) · (q_g · c_g(t)) + Σ_g zero_g(t) · Σ q_g           (fp32 sums of exact products)
    output  o    = Σ_t Σ_g (p(t) · scale_g(t)) · c_g(t) + Σ_g Σ_t p(t) · zero_g(t),  / Σ_t p(t), rounded to bf16

"bf16" is the BF16 path over a cache holding the same keys in bf16 (against fp64 over that cache); "fp16" is today's
kernel (the query and p·scale in fp16, products exact, fp32 sums); "e4m3 qNpM" keeps N e4m3 terms of the query
(after one factor a row, its largest |q| at 448) and M of p·scale (a power-of-two factor per row and 64-token tile,
its largest at most 448): x = Σ e4m3 terms, each the rounded remainder of the terms before. "s8 qNpM" does the same
with s8 terms, the k-th in units of 2^-7k after a factor that takes the row's largest |q| (or the tile's largest
p·scale, a power of two) to 127 (a remainder of at most half a unit then always fits the next term's ±127); their
products sum exactly in s32, so only the terms round. "s8/e4m3 qNpM" takes s8 terms of the query and e4m3 terms of
p·scale (the output products then accumulate in fp32 across tiles, as e4m3 `wgmma` does). "acc14" rounds every 32-wide partial sum
to 14 significant bits before it joins the fp32 accumulator: a pessimistic model of an 8-bit tensor instruction
that keeps fewer bits inside (measured on the H200 it is not; this brackets it).

    python -m quantmla_lab.bench.kernels.e4m3_operands --out lab/results/kernels/e4m3_operands_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from quantmla_lab.bench.common import parse_fresh, save
from quantmla_lab.bench.kernels.decode_speed import source_commit

E4M3_MAX = 448.0
D_C, D_R, GC, GR = 512, 64, 128, 64


def term_factor(x: torch.Tensor, top: float, tile: int | None = None) -> torch.Tensor:
    """The factor (shaped as x) that takes the largest |x| of each row to `top` (tile None), or the power of two that
    takes the largest of each row's `tile` consecutive values to at most `top` (an accumulator rescaled by 2^k is
    exact)."""
    if tile is None:
        return (top / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)).expand_as(x)
    t = x.reshape(*x.shape[:-1], -1, tile)
    f = torch.exp2(torch.floor(torch.log2(top / t.abs().amax(-1, keepdim=True).clamp_min(1e-30))))
    return f.expand_as(t).reshape(x.shape)


def e4m3_terms(x: torch.Tensor, n: int, tile: int | None = None) -> torch.Tensor:
    """x (fp64, [..., K]) as the sum of n e4m3 terms, each the rounded remainder of the terms before, after the
    factor to 448 (term_factor)."""
    f = term_factor(x, E4M3_MAX, tile)
    y, out = x * f, torch.zeros_like(x)
    for _ in range(n):
        out = out + (y - out).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()
    return out / f


def s8_terms(x: torch.Tensor, n: int, tile: int | None = None) -> torch.Tensor:
    """x (fp64, [..., K]) as the sum of n s8 terms in units of 1, 2^-7, 2^-14, ..., each the rounded remainder of
    the terms before (so each is within ±64 after the first: no term is clipped), after the factor to 127
    (term_factor)."""
    f = term_factor(x, 127.0, tile)
    y, out = x * f, torch.zeros_like(x)
    for k in range(n):
        unit = 2.0 ** (-7 * k)
        out = out + torch.round((y - out) / unit).clamp(-127, 127) * unit
    return out / f


def round_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x rounded to `bits` significant bits (round to nearest)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 2.0**bits) / 2.0**bits, e)


def chunked_dot(a: torch.Tensor, b: torch.Tensor, acc_bits: int | None) -> torch.Tensor:
    """a [..., K] · b [K, N] in fp32 as the tensor pipe sums it: 32-wide partial sums (each rounded to
    acc_bits significant bits when given) added into an fp32 accumulator."""
    K = a.shape[-1]
    acc = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=torch.float32)
    for k in range(0, K, 32):
        part = a[..., k:k + 32].double() @ b[k:k + 32].double()
        part = round_bits(part, acc_bits) if acc_bits else part
        acc = acc + part.float()
    return acc


def make_cache(T: int, c_bits: int, g: torch.Generator):
    """Codes [T, 576] and per-token (scale, zero) per group [T, G] of random N(0, 1) keys, fp16 metadata."""
    x = torch.randn(T, D_C + D_R, generator=g, dtype=torch.float64)
    x[:, D_C:] *= 4.0  # the RoPE key's larger range
    codes, scales, zeros = [], [], []
    for lo, hi, gs, bits in ((0, D_C, GC, c_bits), (D_C, D_C + D_R, GR, 4)):
        xg = x[:, lo:hi].reshape(T, -1, gs)
        mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        s = ((mx - mn) / (2**bits - 1)).half().double()
        z = mn.half().double()
        codes.append(torch.round((xg - z) / s).clamp(0, 2**bits - 1).reshape(T, -1))
        scales.append(s[..., 0])
        zeros.append(z[..., 0])
    return torch.cat(codes, 1), torch.cat(scales, 1), torch.cat(zeros, 1)


def group_of_channel() -> torch.Tensor:
    return torch.cat([torch.arange(D_C) // GC, D_C // GC + torch.arange(D_R) // GR])


def decode(q: torch.Tensor, codes, scales, zeros, sm_scale: float, mode: str, acc_bits: int | None) -> torch.Tensor:
    """The output [H, d_c] by one arithmetic: "fp64" (reference), "fp64 bf16" (reference over the cache rounded
    to bf16), "bf16" (the BF16 path over that cache: fp32 sums, p in bf16), "fp16" (today's kernel), "e4m3 qNpM"
    (N e4m3 terms of the query, M of p·scale)."""
    gch = group_of_channel()
    k = codes * scales[:, gch] + zeros[:, gch]  # [T, 576] the dequantized cache, fp64
    if mode.startswith("fp64"):
        k = k.bfloat16().double() if mode == "fp64 bf16" else k
        s = (q @ k.T) * sm_scale
        return torch.softmax(s, -1) @ k[:, :D_C]
    if mode == "bf16":
        kb = k.bfloat16().double()
        s = chunked_dot(q, kb.T, acc_bits).double() * sm_scale
        p = torch.exp(s - s.amax(-1, keepdim=True)).float().double()
        o = chunked_dot(p.bfloat16().double(), kb[:, :D_C], acc_bits).double() / p.sum(-1, keepdim=True)
        return o.bfloat16().double()
    nq, n = (int(mode[-3]), int(mode[-1])) if mode[:2] in ("e4", "s8") else (0, 0)  # "e4m3 q2p3": terms of q, of p
    qfmt, pfmt = (mode.split()[0].split("/") * 2)[:2]  # "s8/e4m3 q2p2": s8 terms of q, e4m3 of p·scale
    terms = {"s8": s8_terms, "e4m3": e4m3_terms}
    q_bits = None if qfmt == "s8" else acc_bits  # s32 sums are exact
    p_bits = None if pfmt == "s8" else acc_bits
    qq = q.half().double() if nq == 0 else terms[qfmt](q, nq)
    G = int(gch.max()) + 1
    s = torch.zeros(q.shape[0], codes.shape[0], dtype=torch.float64)
    for grp in range(G):  # each group's products on their own accumulators, the scale folded in fp32
        ch = gch == grp
        s += (chunked_dot(qq[:, ch], codes[:, ch].T, q_bits).double() * scales[:, grp].float().double()).float().double()
        s += zeros[:, grp].float().double() * qq[:, ch].sum(-1, keepdim=True)
    s = s.float().double() * sm_scale
    p = torch.exp(s - s.amax(-1, keepdim=True)).float().double()
    o = torch.zeros(q.shape[0], D_C, dtype=torch.float64)
    for grp in range(D_C // GC):
        ch = gch == grp
        ps = p * scales[:, grp].float().double()[None, :]  # [H, T] p·scale of the group
        ps = ps.half().double() if n == 0 else terms[pfmt](ps, n, tile=64)
        o[:, ch[:D_C]] = chunked_dot(ps, codes[:, ch], p_bits).double() + (p @ zeros[:, grp].float().double())[:, None]
    return (o / p.sum(-1, keepdim=True)).bfloat16().double()


MODES = ["bf16", "fp16", "e4m3 q1p1", "e4m3 q2p2", "e4m3 q3p2", "e4m3 q2p3", "e4m3 q3p3", "s8 q1p2", "s8 q2p1",
         "s8 q2p2", "s8/e4m3 q2p2", "s8/e4m3 q2p3"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=MODES,
                    help='arithmetics to emulate ("s8 q2p0": two s8 terms of the query, p·scale in fp16 as today)')
    ap.add_argument("--out", required=True)
    a = parse_fresh(ap)
    modes = a.modes
    res = {"device": "cpu (emulated arithmetic)", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": source_commit(),
        "command": " ".join(["python -m quantmla_lab.bench.kernels.e4m3_operands", *sys.argv[1:]]),
        "heads": a.heads, "metric": "||o - o_fp64|| / ||o_fp64|| over the H x d_c output, median of trials", "rows": []}
    for c_bits in (4, 2):
        for T in a.tokens:
            for acc_bits in (None, 14):
                errs = {m: [] for m in modes}
                for trial in range(a.trials):
                    g = torch.Generator().manual_seed(1000 * trial + T + c_bits)
                    codes, scales, zeros = make_cache(T, c_bits, g)
                    q = torch.randn(a.heads, D_C + D_R, generator=g, dtype=torch.float64).bfloat16().double()
                    sm = 1.0 / (192 ** 0.5)
                    ref = decode(q, codes, scales, zeros, sm, "fp64", None)
                    ref_bf16 = decode(q, codes, scales, zeros, sm, "fp64 bf16", None)  # the BF16 path's own cache
                    for m in modes:
                        o = decode(q, codes, scales, zeros, sm, m, acc_bits)
                        r = ref_bf16 if m == "bf16" else ref
                        errs[m].append(float((o - r).norm() / r.norm()))
                row = {"format": f"INT{c_bits}/INT4", "tokens": T, "acc_bits": acc_bits or "fp32",
                       **{m: sorted(v)[len(v) // 2] for m, v in errs.items()}}
                res["rows"].append(row)
                print(" ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    save(res, a.out)


if __name__ == "__main__":
    main()
