"""`quantmla bytes`: bytes per token per layer of cache formats, and paged compression."""

from __future__ import annotations

import json

from quantmla.cache.layout import (
    DEFAULT_PAGE_SIZE,
    FP8_DS_MLA,
    CacheFormat,
    PageLayout,
    TokenLayout,
    compression,
)
from quantmla.quant.format import BF16, PathFormat

TOKENS = (4096, 32768, 131072)


def standard_formats(groups=(32, 64, 128), rope_group: int = 64, fp8: bool = True) -> list[tuple[str, CacheFormat]]:
    """BF16, FP8 (fp8_ds_mla, when its 128-channel groups fit) and INT8/INT4/INT2 at each group size."""
    rows = [("BF16", CacheFormat(BF16, BF16))]
    if fp8:
        rows.append(("FP8 (fp8_ds_mla)", FP8_DS_MLA))
    for g in groups:
        rg = min(g, rope_group)
        rows += [
            (f"INT8/INT8 g{g}", CacheFormat(PathFormat(8, g), PathFormat(8, rg))),
            (f"INT4/INT4 g{g}", CacheFormat(PathFormat(4, g), PathFormat(4, rg))),
            (f"INT2/INT4 g{g}", CacheFormat(PathFormat(2, g), PathFormat(4, rg))),
        ]
    return rows


def table(d_c: int, d_r: int, page_size: int = DEFAULT_PAGE_SIZE, rope_group: int = 64) -> list[dict]:
    out = []
    # groups that fit the paths (a small checkpoint's d_c / d_r may be below the standard group sizes)
    groups = tuple(g for g in (32, 64, 128) if g <= d_c and d_c % g == 0) or (d_c,)
    for name, fmt in standard_formats(groups, rope_group=min(rope_group, d_r), fp8=d_c % 128 == 0):
        t = TokenLayout(d_c, d_r, fmt)
        row = {"format": name, "describe": fmt.describe(), **t.field_bytes, "bytes_per_token": t.bytes_per_token,
               "page_bytes": PageLayout(t, page_size).page_bytes}
        row.update({f"compression_{n // 1024}K": round(compression(d_c, d_r, fmt, n, page_size), 3) for n in TOKENS})
        out.append(row)
    return out


def add_arguments(p):
    p.add_argument("--d-c", type=int, default=512, help="latent rank kv_lora_rank")
    p.add_argument("--d-r", type=int, default=64, help="RoPE key dim qk_rope_head_dim")
    p.add_argument("--rope-group", type=int, default=64, help="RoPE group size cap (a power of two)")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="tokens per page")
    p.add_argument("--model", help="read d_c and d_r from this checkpoint directory instead")
    p.add_argument("--json", action="store_true", help="print JSON")


def check_dims(d_c: int, d_r: int, rope_group: int, page_size: int, source: str = "") -> None:
    """Refuse dims and sizes the table cannot lay out, naming the flag (or the checkpoint `source`)."""
    from quantmla.checks import check_positive
    from quantmla.errors import UnsupportedFormatError

    d_c_name, d_r_name = (f"{source}: kv_lora_rank", f"{source}: qk_rope_head_dim") if source else ("--d-c", "--d-r")
    check_positive(page_size, "--page-size", integer=True)
    check_positive(rope_group, "--rope-group", integer=True)
    check_positive(d_c, d_c_name, integer=True)
    check_positive(d_r, d_r_name, integer=True)
    if rope_group & (rope_group - 1):
        raise UnsupportedFormatError(f"--rope-group {rope_group} is not a power of two; use e.g. 32 or 64")
    if not any(d_c % g == 0 for g in (32, 64, 128)) and d_c & (d_c - 1):
        raise UnsupportedFormatError(
            f"{d_c_name} {d_c}: no group size of 32, 64 or 128 divides it and it is not a power of two, so no content "
            "group fits; MLA models use a multiple of 32 (e.g. 512)")
    rg = min(rope_group, d_r)
    if d_r % rg or rg & (rg - 1):
        raise UnsupportedFormatError(
            f"{d_r_name} {d_r}: the RoPE group (--rope-group {rope_group}, capped at d_r) does not divide it into "
            "power-of-two groups; MLA models use e.g. 64, or pick a --rope-group that divides it")


def run(args) -> int:
    d_c, d_r = args.d_c, args.d_r
    if args.model:
        from quantmla.model.spec import load_spec

        s = load_spec(args.model)
        d_c, d_r = s.d_c, s.d_r
    check_dims(d_c, d_r, args.rope_group, args.page_size, args.model or "")
    rows = table(d_c, d_r, args.page_size, args.rope_group)
    if args.json:
        print(json.dumps({"d_c": d_c, "d_r": d_r, "page_size": args.page_size, "rows": rows}, indent=1))
        return 0
    print(f"per token per layer, d_c={d_c}, d_r={d_r}; fp16 scale+zero per group; pages of {args.page_size} tokens")
    hdr = f"{'format':<16}{'codes c':>8}{'codes R':>8}{'meta c':>7}{'meta R':>7}{'bytes':>7}" + "".join(
        f"{'x@' + str(n // 1024) + 'K':>9}" for n in TOKENS)
    print(hdr)
    for r in rows:
        print(f"{r['format']:<16}{r['content_codes']:>8}{r['rope_codes']:>8}{r['content_meta']:>7}{r['rope_meta']:>7}"
              f"{r['bytes_per_token']:>7}" + "".join(f"{r[f'compression_{n // 1024}K']:>9.3f}" for n in TOKENS))
    return 0
