"""The tokens-as-M kernel's RoPE scores on a path grouped per page (R_PAGE: rope_page_tm.cuh), emulated in numpy at
the level of one warp's lanes: each lane's metadata pairs (rope_set_pairs, byte permutes included), the set's power of
two (the largest |scale|'s fp16 exponent, reduced over the lanes t), the scaled query fragments B' = q·(s·2^-e) in
fp16, the code planes masked in place as fp16 subnormals, the mma.sync m16n8k16 products under the PTX fragment
layout (A: a0 row g, k 2t..2t+1; a1 row g + 8; a2 row g, k 2t + 8..; a3 row g + 8, k 2t + 8..; B: b0 k 2t..2t+1,
column g; b1 k 2t + 8..; the query block's ldmatrix pieces at the positions query_tm.cuh's q_position gives), the
zero points' products and the folds. The result must match Σ_c k_c·q_c over the 64 RoPE channels of 16 tokens and
16 rows (k dequantized in fp64 from the same codes and set) within the fp16 rounding of B': 2^-10 of Σ_c |k_c·q_c|.
It checks the kernel's index arithmetic and number formats as copied here, not the hardware's layout (that is the
GPU run's job).

    python -m quantmla_lab.bench.kernels.rope_page_layout
"""

from __future__ import annotations

import numpy as np

D_C, D_R = 512, 64
CKS = D_C // 16  # the content's k-steps: the RoPE key's come after them


def q_position(cr: int, fb_rc: int) -> tuple[int, int]:
    """(k-step, k) of RoPE channel cr in the query block (query_tm.cuh q_position, integer codes)."""
    rw = fb_rc // 16
    p, j = divmod(cr, fb_rc)
    t, s = j // (4 * rw), (j // 4) % rw
    i = j & 3
    return CKS + s * (D_R // fb_rc) + p, 2 * t + (i >> 1) + 8 * (i & 1)


def perm(x: int, y: int, sel: int) -> int:
    """__byte_perm(x, y, sel): result byte n is byte (sel >> 4n) & 7 of the 8 bytes x0..x3 y0..y3."""
    b = x.to_bytes(4, "little") + y.to_bytes(4, "little")
    return int.from_bytes(bytes(b[(sel >> (4 * n)) & 7] for n in range(4)), "little")


def h2(w: int) -> np.ndarray:
    """The two fp16 halves of a 32-bit word (low, high)."""
    return np.frombuffer(w.to_bytes(4, "little"), dtype=np.float16)


def u32(lo: np.float16, hi: np.float16) -> int:
    return int.from_bytes(np.array([lo, hi], dtype=np.float16).tobytes(), "little")


def hmul2(a: int, b: int) -> int:
    return u32(*(h2(a) * h2(b)))  # numpy rounds each fp16 product once (exact in fp32 first)


def set_pairs(meta: bytes, base: int, gs: int, fld: int) -> tuple[int, int, int, int]:
    """rope_set_pairs: (s02, s13, z02, z13) of channels base..base + 3."""
    off = (base // gs) * fld * 2
    w = [int.from_bytes(meta[off + 4 * i: off + 4 * i + 4], "little") for i in range(4 * fld // gs // 2 or 1)]
    if gs == 1 and fld == 2:
        return perm(w[0], w[2], 0x5410), perm(w[1], w[3], 0x5410), perm(w[0], w[2], 0x7632), perm(w[1], w[3], 0x7632)
    if fld == 2:
        s, z = perm(w[0], w[1], 0x5410), perm(w[0], w[1], 0x7632)
        return s, s, z, z
    if gs == 1:
        return perm(w[0], w[1], 0x5410), perm(w[0], w[1], 0x7632), 0, 0
    return w[0], w[0], 0, 0


def subnormals(word: int) -> np.ndarray:
    """The halves of a masked code word read as fp16 values (exact subnormals code·2^(o-24))."""
    return np.array([word & 0xFFFF, word >> 16], dtype=np.float64) * 2.0 ** -24


def emulate(bits: int, gs: int, symmetric: bool, seed: int = 0, scale_span: float = 12.0) -> tuple[float, bool]:
    """One warp's 16 tokens x 16 rows of RoPE scores; returns (largest error relative to Σ|k·q|, within bound)."""
    rng = np.random.default_rng(seed)
    fb_rc, fld = D_R * bits // 8, 1 if symmetric else 2
    rw, npr = fb_rc // 16, 8 // bits
    codes = rng.integers(0, 256, (16, fb_rc), dtype=np.uint8)
    groups = D_R // gs
    scale = (2.0 ** rng.uniform(-scale_span, scale_span, groups)).astype(np.float16)
    zero = (rng.standard_normal(groups) * 2.0 ** rng.uniform(-4, 6, groups)).astype(np.float16)
    fields = [scale] if symmetric else [scale, zero]
    meta = np.stack(fields, 1).astype(np.float16).tobytes()  # [G, F] fp16, group-major
    q = (rng.standard_normal((16, D_R)) * 2.0 ** rng.uniform(-6, 6, (16, 1))).astype(np.float16)
    block = {}
    for n in range(16):
        for cr in range(D_R):
            block[(n,) + q_position(cr, fb_rc)] = q[n, cr]

    def qreg(n: int, kstep: int, k: int) -> int:
        return u32(block[(n, kstep, k)], block[(n, kstep, k + 1)])

    lanes = [(g, t) for g in range(8) for t in range(4)]
    pairs = {(t, s, p): set_pairs(meta, p * fb_rc + 4 * rw * t + 4 * s, gs, fld)
             for t in range(4) for s in range(rw) for p in range(npr)}
    h = 0
    for v in pairs.values():
        for w in v[:2]:
            a = w & 0x7FFF7FFF
            h = max(h, a & 0xFFFF, a >> 16)  # (every lane t's, as the two shuffles leave it)
    e = min(max((h >> 10) - 15, -14), 14)
    inv = (15 - e) << 10
    inv2, f = inv | (inv << 16), 2.0 ** e
    sym = 0xC800C800 if bits == 4 else 0xC000C000
    sc, zsum = np.zeros((16, 16)), np.zeros((16, 16))

    def word(row: int, t: int, s: int) -> int:  # word s of the RW words thread t reads at byte 4·RW·t of a row
        return int.from_bytes(codes[row, 4 * rw * t + 4 * s: 4 * rw * t + 4 * s + 4].tobytes(), "little")

    for p in range(npr):
        racc, zacc = np.zeros((16, 16)), np.zeros((16, 16))
        mask = ((((1 << bits) - 1) << (p * bits)) * 0x10001)
        for s in range(rw):
            kstep = CKS + s * npr + p
            a, b, az, bz = np.zeros((16, 16)), np.zeros((16, 16)), np.zeros((16, 16)), np.zeros((16, 16))
            for g, t in lanes:
                s02, s13, z02, z13 = pairs[(t, s, p)]
                n02, n13 = hmul2(s02, inv2), hmul2(s13, inv2)
                qr = [qreg(g, kstep, 2 * t), qreg(g, kstep, 2 * t + 8), qreg(8 + g, kstep, 2 * t),
                      qreg(8 + g, kstep, 2 * t + 8)]
                br = [hmul2(qr[0], n02), hmul2(qr[1], n13), hmul2(qr[2], n02), hmul2(qr[3], n13)]
                xl, xh = word(g, t, s), word(g + 8, t, s)
                ar = [xl & mask, xh & mask, (xl >> 8) & mask, (xh >> 8) & mask]
                zr = [z02, z02, z13, z13] if not symmetric else [sym] * 4
                for m, regs in ((a, ar), (az, zr)):  # A: a0 (g, 2t), a1 (g + 8, 2t), a2 (g, 2t + 8), a3 (g + 8, ..)
                    vals = [subnormals(r) if m is a else h2(r).astype(np.float64) for r in regs]
                    m[g, 2 * t:2 * t + 2], m[g + 8, 2 * t:2 * t + 2] = vals[0], vals[1]
                    m[g, 2 * t + 8:2 * t + 10], m[g + 8, 2 * t + 8:2 * t + 10] = vals[2], vals[3]
                for m, regs in ((b, br), (bz, qr if not symmetric else br)):  # B: b0 (2t, g), b1 (2t + 8, g)
                    for nb in range(2):
                        m[2 * t:2 * t + 2, 8 * nb + g] = h2(regs[2 * nb]).astype(np.float64)
                        m[2 * t + 8:2 * t + 10, 8 * nb + g] = h2(regs[2 * nb + 1]).astype(np.float64)
            racc += a @ b
            zacc += az @ bz
        sc += racc.astype(np.float32) * np.float32(f * 2.0 ** (24 - p * bits))
        zsum += zacc  # (one accumulator over every plane)
    sc += zsum.astype(np.float32) * (f if symmetric else 1.0)
    chan = np.zeros((16, D_R), dtype=np.float64)  # channel p·fb_rc + byte j of plane p
    for p in range(npr):
        chan[:, p * fb_rc:(p + 1) * fb_rc] = (codes >> (bits * p)) & ((1 << bits) - 1)
    s64, z64 = np.repeat(scale.astype(np.float64), gs), np.repeat(zero.astype(np.float64), gs)
    k = (chan - 2 ** (bits - 1)) * s64 if symmetric else chan * s64 + z64
    ref = k @ q.astype(np.float64).T
    mag = np.abs(k) @ np.abs(q.astype(np.float64)).T
    rel = float((np.abs(sc - ref) / np.maximum(mag, 1e-300)).max())
    return rel, rel <= 2.0 ** -10


def main() -> bool:
    ok = True
    for bits, gs, sym in ((4, 1, False), (4, 2, False), (4, 1, True), (4, 2, True), (2, 1, False), (2, 2, True)):
        for seed in range(3):
            rel, good = emulate(bits, gs, sym, seed)
            ok &= good
        print(f"RoPE INT{bits} groups of {gs} {'symmetric' if sym else 'affine'}: largest error / Σ|k·q| {rel:.2e} "
              f"({'within' if good else 'PAST'} 2^-10)")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
