"""The index bookkeeping of the tokens-as-M kernel's scores on 8-bit warpgroup MMAs (S8_QK: scores_s8.cuh and
query_s8.cuh), emulated in numpy on random codes and query terms: each thread's A registers (its code words masked
by plane), the s8 query block at q8_at(q8_position(c)), the m64n32k32 products under the PTX fragment layout of an
8-bit A operand (register 0: row g, k 4t..4t+3; 1: row g + 8; 2: row g, k 16 + 4t..; 3: row g + 8, k 16 + 4t..) and
the folds (256·term 1 + term 2, plane p divided by 2^(bits·p)) must give Σ code·(256·q1 + q2) over the 576 channels
exactly, for INT4/INT4 and INT2/INT4.
It checks the kernel's index arithmetic as copied here, not the hardware's layout (that is the GPU run's job).

    python -m quantmla_lab.bench.kernels.s8_layout
"""

from __future__ import annotations

import numpy as np

D_C, FB_RC = 512, 32  # 32 RoPE code bytes a token (4-bit codes)


def mask(bits: int, p: int) -> int:
    """Plane p of a register's 4 bytes of `bits`-bit codes: the u8 value c·2^(bits·p) (scores_s8.cuh plane_mask)."""
    return (((1 << bits) - 1) << (bits * p)) * 0x01010101


def q8_at(s: int, n: int, k: int) -> int:
    """Byte of element (row n, k) of k-step s in the s8 query block (query_s8.cuh)."""
    return s * 1024 + (k >> 4) * 512 + (n >> 3) * 128 + (n & 7) * 16 + (k & 15)


def q8_position(c: int, c_bits: int) -> tuple[int, int]:
    """(k-step, k) of channel c, a multiple of 4 (query_s8.cuh)."""
    fb_cc, npc = D_C * c_bits // 8, 8 // c_bits
    if c < D_C:
        p, b = divmod(c, fb_cc)
        m, t, h, u = b >> 6, (b >> 4) & 3, (b >> 3) & 1, (b >> 2) & 1
        return (2 * m + h) * npc + p, 16 * u + 4 * t
    p, b = divmod(c - D_C, FB_RC)
    return 16 + p, 16 * ((b >> 2) & 1) + 4 * (b >> 3)


def word(codes: np.ndarray, row: int, byte: int) -> int:
    return int.from_bytes(codes[row, byte:byte + 4].tobytes(), "little")


def product(frags: dict, b: np.ndarray) -> np.ndarray:
    """One m64n32k32 product: A [64, 32] from each thread's four registers (frags[(warp, g, t)]), times b [32, 32]."""
    a = np.zeros((64, 32), dtype=np.int64)
    for (w, g, t), regs in frags.items():
        for j in range(4):
            byte = [(r >> (8 * j)) & 255 for r in regs]
            a[16 * w + g, 4 * t + j], a[16 * w + g + 8, 4 * t + j] = byte[0], byte[1]
            a[16 * w + g, 16 + 4 * t + j], a[16 * w + g + 8, 16 + 4 * t + j] = byte[2], byte[3]
    return a @ b


def main(c_bits: int, seed: int = 0) -> bool:
    fb_cc, npc = D_C * c_bits // 8, 8 // c_bits  # content code bytes a token, planes of a byte
    rng = np.random.default_rng(seed)
    content = rng.integers(0, 256, (64, fb_cc), dtype=np.uint8)  # a tile's 64 tokens
    rope = rng.integers(0, 256, (64, FB_RC), dtype=np.uint8)
    q1, q2 = rng.integers(-127, 128, (16, 576)), rng.integers(-127, 128, (16, 576))

    block = np.zeros(18 * 1024, dtype=np.int64)  # the s8 query block as store_piece_s8 writes it
    for n in range(16):
        for c in range(0, 576, 4):
            s, k = q8_position(c, c_bits)
            for j in range(4):
                block[q8_at(s, n, k + j)], block[q8_at(s, 16 + n, k + j)] = q1[n, c + j], q2[n, c + j]

    def b_of(s: int) -> np.ndarray:
        return np.array([[block[q8_at(s, n, k)] for n in range(32)] for k in range(32)])

    def fold(acc: np.ndarray, bits: int, plane: int) -> np.ndarray:
        v = acc[:, :16] * 256 + acc[:, 16:]
        return v // 2 ** (bits * plane)  # plane p's codes are c·2^(bits·p): exact

    scores = np.zeros((64, 16), dtype=np.int64)
    threads = [(w, g, t) for w in range(4) for g in range(8) for t in range(4)]
    nbp, npp = fb_cc // 128, npc // 2  # block pairs, plane pairs (tile_scores_s8's batches)
    for bt in range(nbp * npp):
        bp, p0 = bt // npp, 2 * (bt % npp)
        acc = [np.zeros((64, 32), dtype=np.int64) for _ in range(2)]
        for m in (2 * bp, 2 * bp + 1):
            for h in range(2):
                for j in range(2):
                    mk = mask(c_bits, p0 + j)
                    frags = {}
                    for w, g, t in threads:
                        lo, col = 16 * w + g, 16 * (4 * m + t)
                        xl = [word(content, lo, col + 4 * i) for i in range(4)]
                        xh = [word(content, lo + 8, col + 4 * i) for i in range(4)]
                        frags[(w, g, t)] = (xl[2 * h] & mk, xh[2 * h] & mk, xl[2 * h + 1] & mk, xh[2 * h + 1] & mk)
                    acc[j] += product(frags, b_of((2 * m + h) * npc + p0 + j))
        scores += fold(acc[0], c_bits, p0) + fold(acc[1], c_bits, p0 + 1)
    for p in range(2):  # the RoPE key: 8 bytes at 8t of each row
        frags = {}
        for w, g, t in threads:
            lo = 16 * w + g
            mk = mask(4, p)
            frags[(w, g, t)] = (word(rope, lo, 8 * t) & mk, word(rope, lo + 8, 8 * t) & mk,
                                word(rope, lo, 8 * t + 4) & mk, word(rope, lo + 8, 8 * t + 4) & mk)
        scores += fold(product(frags, b_of(16 + p)), 4, p)

    codes = np.zeros((64, 576), dtype=np.int64)  # channel p·fb_cc + byte (content), 512 + p·32 + byte (RoPE)
    for p in range(npc):
        codes[:, p * fb_cc:(p + 1) * fb_cc] = (content >> (c_bits * p)) & (2 ** c_bits - 1)
    for p in range(2):
        codes[:, D_C + p * FB_RC:D_C + (p + 1) * FB_RC] = (rope >> (4 * p)) & 15
    direct = codes @ (256 * q1 + q2).T
    ok = bool(np.array_equal(scores, direct))
    print(f"INT{c_bits}/INT4 exact: {ok} (largest difference {np.abs(scores - direct).max()})")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if all([main(4), main(2)]) else 1)
