"""What a ``quantmla bench-kernel`` result says: the decode-path goals it meets, its figure, its file."""

from __future__ import annotations

from pathlib import Path

from quantmla.cache.layout import PRESETS as METHODS


def goals(res: dict) -> dict:
    """The decode-path goals, each the worst case over the shapes it covers (None: not measured)."""
    rows = res.get("rows", [])

    def sel(H, m, min_tokens=0):
        return [r for r in rows if r["heads"] == H and r["method"] == m and r["batch"] * r["context"] >= min_tokens]

    def mn(rs, k):
        v = [r[k] for r in rs if r.get(k) is not None]
        return min(v) if v else None

    one = [r for r in sel(16, "int4/int4") if (r["batch"], r["context"]) == (1, 131072)]
    comp = {(r["format"], r["tokens"]): r["compression"] for r in res.get("compression", [])}
    return {
        "int4_vs_peer_16h_128k_tokens_min (>=3.0)": mn(sel(16, "int4/int4", 131072), "speedup_vs_peer"),
        "int4_frac_copy_16h_128k_tokens_min (>=0.6)": mn(sel(16, "int4/int4", 131072), "frac_copy"),
        "int2_vs_peer_16h_128k_tokens_min (>=4.5)": mn(sel(16, "int2/int4", 131072), "speedup_vs_peer"),
        "fp8_vs_peer_16h_128k_tokens_min (>=1.7)": mn(sel(16, "fp8", 131072), "speedup_vs_peer"),
        "int4_1x131072_us (<=25)": one[0]["ms"] * 1e3 if one else None,
        "bf16_vs_peer_16h_min (>=1.15)": mn(sel(16, "bf16"), "speedup_vs_peer"),
        "bf16_frac_copy_16h_min (>=0.8)": mn(sel(16, "bf16"), "frac_copy"),
        "bf16_TFLOPs_128h_min (>=450)": mn(sel(128, "bf16"), "TFLOPs"),
        "int4_vs_bf16_128h_min (>=1.0)": mn(sel(128, "int4/int4"), "speedup_vs_bf16"),
        "int4_vs_peer_128h_min (>=2.0)": mn(sel(128, "int4/int4"), "speedup_vs_peer"),
        "compression_int4_128k (>=3.59)": comp.get((METHODS["int4/int4"].describe(), 131072)),
        "compression_int2_128k": comp.get((METHODS["int2/int4"].describe(), 131072)),
    }


def plot(res: dict, path: str | Path) -> Path:
    """Speedup over the peer's best BF16 decode (over our BF16 when no peer ran), per shape and format,
    one panel per head count; saved as a PNG beside the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    heads = sorted({r["heads"] for r in rows})
    ref = "speedup_vs_peer" if any(r.get("speedup_vs_peer") for r in rows) else "speedup_vs_bf16"
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "peer-bf16"]
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.2), squeeze=False)
    for ax, H in zip(axes[0], heads):
        shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows if r["heads"] == H))
        w = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            ys = [next((r[ref] or 0 for r in rows if r["heads"] == H and r["method"] == m and (r["batch"], r["context"]) == sh), 0)
                  for sh in shapes]
            ax.bar([k + (i - (len(methods) - 1) / 2) * w for k in range(len(shapes))], ys, w, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(shapes)), [f"{b}x{c // 1024}K" for b, c in shapes], rotation=20)
        ax.set_title(f"{H} heads (d_c {res['d_c']}, d_r {res['d_r']})")
        ax.set_xlabel("batch x context")
        ax.set_ylabel("speedup over the peer's best BF16" if ref == "speedup_vs_peer" else "speedup over our BF16")
        ax.legend(fontsize=8)
    fig.suptitle(f"decode step, {res['device']}, CUDA-graph medians")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

