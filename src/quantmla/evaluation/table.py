"""results/accuracy.json and the Markdown table results/accuracy.md.

JSON: {"eval_mode", "settings", "rows": [row, ...], "goals": [...]}; a row has model, config, method,
format, bits_per_byte, retrieval {"1024": {"accuracy", "n"}, ...}, bytes_per_token (per token per MLA
layer), eval_mode, and (once a BF16 row of its model exists) bpb_increase_pct, retrieval_delta_points.
"""

from __future__ import annotations

import json
import os

from quantmla.errors import QuantMLAError
from quantmla.evaluation.harness import EVAL_MODE, METHODS, RETRIEVAL_LENGTHS, finite, goals, relative

REQUIRED = ("model", "config", "method", "bits_per_byte", "retrieval", "bytes_per_token", "eval_mode")
METHOD_ORDER = ["bf16", "rtn", "kivi", "hadamard", "quantmla-content", "quantmla-rope", "quantmla"]


def check_row(r: dict) -> None:
    missing = [k for k in REQUIRED if k not in r]
    if missing:
        raise QuantMLAError(f"accuracy row {r.get('model')}/{r.get('config')}/{r.get('method')} lacks {missing}")
    if not isinstance(r["bytes_per_token"], (int, float)) or r["bytes_per_token"] <= 0:
        raise QuantMLAError(f"accuracy row {r['model']}/{r['config']}/{r['method']}: bytes_per_token must be positive, "
                            f"got {r['bytes_per_token']!r}")


def _sort_key(r: dict):
    cfg_order = {"BF16": 0, "FP8": 1}
    m = METHOD_ORDER.index(r["method"]) if r["method"] in METHOD_ORDER else len(METHOD_ORDER)
    return (r["model"], -r["bytes_per_token"], cfg_order.get(r["config"], 2), r["config"], m)


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of `new` replace rows of `old` with the same (model, config, method)."""
    keyed = {(r["model"], r["config"], r["method"]): r for r in old}
    for r in new:
        keyed[(r["model"], r["config"], r["method"])] = r
    return sorted(keyed.values(), key=_sort_key)


def _fmt_bytes(b: float) -> str:
    return f"{b:.0f}" if abs(b - round(b)) < 1e-9 else f"{b:.1f}"


def _fmt_pct(x) -> str:
    return "—" if x is None else f"{x:+.2f}%"


def markdown(rows: list[dict], settings: dict | None = None, lengths=RETRIEVAL_LENGTHS) -> str:
    """The table the README shows: one block per model, BF16 first, every row with its bytes per token."""
    for r in rows:
        check_row(r)
    rows = relative(sorted([dict(r) for r in rows], key=_sort_key))
    out = ["# Accuracy under a quantized MLA cache", ""]
    modes = sorted({r["eval_mode"] for r in rows})
    out.append(f"Evaluation mode: **{EVAL_MODE}** — every attention read, the prefill's included, goes through "
               "the quantized cache, as a token-by-token decode would see it.")
    if any(m != EVAL_MODE for m in modes):
        out.append("Rows marked † keep KIVI's residual (the newest RoPE keys of an unfinished block) at full precision, "
                   "as KIVI does.")
    datas = {json.dumps(r["data"], sort_keys=True) for r in rows if r.get("data")}
    data_keys = set(datas)
    mixed = len(datas) > 1 or len({r.get("device") for r in rows}) > 1
    if len(datas) == 1:
        d = json.loads(datas.pop())
        out += ["", "Settings: " + ", ".join(f"{k} {v}" for k, v in d.items()) + "."]
    elif len(datas) > 1:
        out += ["", "Rows were computed with different data settings: the `run` column names each row's "
                "(retrieval samples per length are in each cell; full settings in each row's `data` in accuracy.json)."]
        for i, d in enumerate(sorted(datas)):
            out.append(f"- settings {chr(65 + i)}: " + ", ".join(f"{k} {v}" for k, v in json.loads(d).items()))
    elif settings:
        out += ["", "Settings: " + ", ".join(f"{k} {v}" for k, v in settings.items() if not isinstance(v, (dict, list))) + "."]
    out += ["", "Bits per byte (bpb) of held-out text (lower is better; Δ vs the model's BF16 row); retrieval: "
            "exact greedy answer of a key lookup buried in code, at each total length. "
            "Bytes/token: per token per MLA layer, codes + scales + zero points (KIVI: per-channel block metadata "
            "amortized over the block)."]
    for model in sorted({r["model"] for r in rows}):
        R = [r for r in rows if r["model"] == model]
        out += ["", f"## {model}", ""]
        head = ["config", "method", "B/token", "bpb", "Δ bpb"] + [f"retr. {L // 1024}K" if L % 1024 == 0 else f"retr. {L}"
                                                                 for L in lengths]
        if mixed:
            head.append("run")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
        for r in R:
            mark = " †" if r["eval_mode"] != EVAL_MODE else ""
            cells = [r["config"], r["method"] + mark, _fmt_bytes(r["bytes_per_token"]), f"{r['bits_per_byte']:.4f}",
                     "—" if r["method"] == "bf16" else _fmt_pct(r.get("bpb_increase_pct"))]
            for L in lengths:
                v = r["retrieval"].get(str(L))
                cells.append("—" if v is None else f"{100 * v['accuracy']:.1f} (n={v['n']})")
            if mixed:
                tag = chr(65 + sorted(data_keys).index(json.dumps(r["data"], sort_keys=True))) if r.get("data") else "?"
                cells.append(f"{tag}, {r.get('device', '?')}")
            out.append("| " + " | ".join(cells) + " |")
    G = goals(rows)
    if any(len(g) > 1 for g in G):
        out += ["", "## Issue-4 goals", ""]
        for g in G:
            for k, v in g.items():
                if k == "model":
                    continue
                verdict = "met" if v["met"] else "NOT met"
                figs = ", ".join(f"{a} {b:.2f}" if isinstance(b, float) else f"{a} {b}" for a, b in v.items() if a != "met")
                out.append(f"- {g['model']} — {k}: **{verdict}** ({figs})")
    out += ["", "Methods: " + "; ".join(f"`{k}` {v}" for k, v in METHODS.items()) + "."]
    return "\n".join(out) + "\n"


def write(rows: list[dict], out_dir: str, settings: dict | None = None, merge: bool = True) -> tuple[str, str]:
    """Write (merging with existing rows when `merge`) accuracy.json and accuracy.md under out_dir."""
    for r in rows:
        check_row(r)
    os.makedirs(out_dir, exist_ok=True)
    jpath, mpath = os.path.join(out_dir, "accuracy.json"), os.path.join(out_dir, "accuracy.md")
    old = []
    if merge and os.path.exists(jpath):
        with open(jpath) as f:
            old = json.load(f).get("rows", [])
    allrows = relative(merge_rows(old, rows))
    doc = {"eval_mode": EVAL_MODE, "settings": settings or {}, "rows": allrows, "goals": goals(allrows)}
    with open(jpath, "w") as f:
        json.dump(finite(doc), f, indent=1)
    with open(mpath, "w") as f:
        f.write(markdown(allrows, settings))
    return jpath, mpath
