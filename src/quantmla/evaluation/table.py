"""Result files of `quantmla eval`: <out>/accuracy.json and the Markdown table <out>/accuracy.md.

JSON: {"eval_mode", "data", "rows": [row, ...]}. A row has model, config, method, format,
bits_per_byte, retrieval {"1024": {"accuracy", "n", "per_sample"}, ...}, bytes_per_token (per token per MLA layer),
eval_mode, `data` (the data settings it was measured on, DATA_KEYS) and `setup` (how the row's cache
was set up, SETUP_KEYS: group sizes, full-precision window, calibration size). Once a BF16 row of the
same model and the same data exists, rows also carry bpb_increase_pct and retrieval_delta_points. A retrieval's
per_sample outcomes are a list of booleans in memory and a string of "1" and "0" in the file (:func:`pack_samples`;
files that hold lists load as well).

Rules:
- rows join a file only when they were measured on the same data as the rows there (every key of
  DATA_KEYS): a merge that mixes data settings is refused, naming them;
- a row is identified by (model, config, method, setup); a row already in the file is replaced only
  when the caller asks for it (`replace=True`, the CLI's --replace-rows);
- rows that carry fingerprints (`provenance`: {"model", "heldout"}, ``evaluation.provenance``) join a file only
  when those of its rows match: a checkpoint or a held-out set of the same name but other files is refused (rows
  written before fingerprints are matched by name only);
- a row's bits per byte are compared only with rows of its model measured on identical perplexity
  data (PPL_KEYS), its retrieval only with rows of identical retrieval data as well. A file written
  before these rules may hold several data settings; its table names them (settings A, B, ...).
"""

from __future__ import annotations

import json
import os

from quantmla.errors import QuantMLAError
from quantmla import jsonfile
from quantmla.evaluation.harness import EVAL_MODE, METHODS, read_in_one_forward
from quantmla.evaluation.intervals import paired_difference, wilson

REQUIRED = ("model", "config", "method", "bits_per_byte", "retrieval", "bytes_per_token", "eval_mode")
METHOD_ORDER = ["bf16", "rtn", "kivi", "hadamard", "quantmla-content", "quantmla-rope", "quantmla",
                "quantmla-content-rope-channel", "quantmla-rope-channel-pagefit", "quantmla-rope-channel"]
# what a row's bits per byte were measured on, and what its retrieval was measured on
PPL_KEYS = ("heldout", "kind", "seq_len", "ppl_chunks", "seed")
DATA_KEYS = PPL_KEYS + ("retrieval_n", "retrieval_lengths", "retrieval_formats")
CALIB_KEYS = ("calib_rows", "calib_len", "calib_steps")  # calibration settings: only rows that read calibration data
# how a row's cache was set up: part of the row's identity (rows with other setups sit side by side)
SETUP_KEYS = ("content_group", "rope_group", "content_clip", "rope_block", "kivi_block", "fp_window") + CALIB_KEYS


class ResultMergeError(QuantMLAError):
    """Rows of different data settings, or an existing row, would be mixed into one result file."""


def check_row(r: dict) -> None:
    missing = [k for k in REQUIRED if k not in r]
    if missing:
        raise QuantMLAError(f"accuracy row {r.get('model')}/{r.get('config')}/{r.get('method')} lacks {missing}")
    if not isinstance(r["bytes_per_token"], (int, float)) or r["bytes_per_token"] <= 0:
        raise QuantMLAError(f"accuracy row {r['model']}/{r['config']}/{r['method']}: bytes_per_token must be positive, "
                            f"got {r['bytes_per_token']!r}")


def data_of(r: dict) -> dict:
    """The row's data settings (DATA_KEYS present in its `data`)."""
    d = r.get("data") or {}
    return {k: d[k] for k in DATA_KEYS if k in d}


def ppl_data_of(r: dict) -> str:
    """The row's perplexity data settings as a comparable key."""
    d = r.get("data") or {}
    return json.dumps({k: d.get(k) for k in PPL_KEYS}, sort_keys=True)


def setup_of(r: dict) -> dict:
    """The row's cache setup; BF16 rows have none (nothing is grouped, windowed or calibrated)."""
    if r["method"] == "bf16":
        return {}
    s = dict(r.get("setup") or {})
    for k in SETUP_KEYS:  # rows written before `setup` existed kept these in `data`
        if k not in s and k in (r.get("data") or {}):
            s[k] = r["data"][k]
    s.setdefault("fp_window", 0)
    from quantmla.evaluation.harness import CALIBRATED

    if r["method"] not in CALIBRATED and not r["config"].startswith("MIX"):  # read no calibration data
        for k in CALIB_KEYS:
            s.pop(k, None)
    content, _, rope = r["config"].partition("/")
    for path, key in ((content, "content_group"), (rope, "rope_group")):
        if path == "BF16" and key in s:  # an unquantized path has no groups
            s[key] = None
    return {k: s[k] for k in SETUP_KEYS if k in s}


def row_key(r: dict) -> tuple:
    return (r["model"], r["config"], r["method"], json.dumps(setup_of(r), sort_keys=True))


def _sort_key(r: dict):
    cfg_order = {"BF16": 0, "FP8": 1}
    m = METHOD_ORDER.index(r["method"]) if r["method"] in METHOD_ORDER else len(METHOD_ORDER)
    s = setup_of(r)
    return (r["model"], s.get("fp_window", 0), -r["bytes_per_token"], cfg_order.get(r["config"], 2), r["config"], m,
            -(s.get("content_group") or 0), -(s.get("rope_group") or 0))


def describe_difference(a: dict, b: dict, a_name: str = "the file", b_name: str = "this run") -> str:
    """'ppl_chunks 64 (the file) vs 2 (this run), retrieval_n 100 vs 2' for the keys that differ."""
    keys = [k for k in DATA_KEYS if a.get(k) != b.get(k)]
    return ", ".join(f"{k} {a.get(k, 'unset')} ({a_name}) vs {b.get(k, 'unset')} ({b_name})" for k in keys)


def check_same_data(rows: list[dict], where: str = "the rows") -> dict | None:
    """The one data setting of `rows` (None for no rows), or ResultMergeError naming the differences."""
    datas = []
    for r in rows:
        d = data_of(r)
        if d not in datas:
            datas.append(d)
    if len(datas) > 1:
        raise ResultMergeError(f"{where} mix data settings: {describe_difference(datas[0], datas[1], 'some rows', 'others')}; "
                               "keep each data setting in its own --out directory")
    return datas[0] if datas else None


def pack_samples(rows: list[dict]) -> list[dict]:
    """Copies of `rows` whose retrieval per_sample lists of booleans are strings of "1" and "0" (the file's form:
    a character a sample instead of a JSON boolean)."""
    def pack(v):
        ps = v.get("per_sample")
        return {**v, "per_sample": "".join("1" if x else "0" for x in ps)} if isinstance(ps, list) else v
    return [{**r, "retrieval": {L: pack(v) for L, v in r["retrieval"].items()}} if isinstance(r.get("retrieval"), dict)
            else r for r in rows]


def unpack_samples(rows: list[dict], where: str) -> list[dict]:
    """`rows` as read from a file, their per_sample strings turned back into lists of booleans (in place); a string
    with other characters than "0" and "1" is refused, naming `where`."""
    for r in rows:
        for L, v in (r.get("retrieval") or {}).items():
            ps = v.get("per_sample") if isinstance(v, dict) else None
            if isinstance(ps, str):
                if set(ps) - {"0", "1"}:
                    raise QuantMLAError(f"{where}: row {r.get('model')} {r.get('config')} {r.get('method')} holds "
                                        f"per_sample {ps[:20]!r} at {L} tokens, which is not a string of 0 and 1")
                v["per_sample"] = [c == "1" for c in ps]
    return rows


def load(out_dir: str) -> list[dict]:
    """The rows of <out_dir>/accuracy.json ([] when there is none), per_sample outcomes as lists of booleans."""
    jpath = os.path.join(out_dir, "accuracy.json")
    if not os.path.exists(jpath):
        return []
    try:
        with open(jpath) as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantMLAError(f"{jpath} is not a result file ({e}); give another --out, or --overwrite to replace it") from None
    return unpack_samples(list(doc.get("rows", [])), jpath)


def check_merge(old: list[dict], data: dict, replace: bool, out_dir: str, new_keys=(),
                provenance: dict | None = None) -> None:
    """Before any work: rows measured on `data` may join `old` (the rows already in out_dir).
    Refuses a file of other data settings, rows whose fingerprints differ from this run's (`provenance`:
    {"heldout": fingerprint, "models": {name: fingerprint}}), and existing rows named in `new_keys` unless
    `replace`."""
    if not old:
        return
    here = check_same_data(old, f"{out_dir}/accuracy.json")
    if here != data:
        raise ResultMergeError(
            f"{out_dir}/accuracy.json holds rows measured on other data: {describe_difference(here, data)}. "
            "Rows are merged only with rows of identical data settings: give another --out, or --overwrite to "
            "replace the file")
    if provenance is not None:
        check_provenance(old, provenance, out_dir)
    if not replace:
        have = {row_key(r) for r in old}
        clash = [k for k in new_keys if k in have]
        if clash:
            names = ", ".join(f"{m} {c} {meth}" for m, c, meth, _ in clash[:4]) + (" ..." if len(clash) > 4 else "")
            raise ResultMergeError(
                f"{out_dir}/accuracy.json already has {len(clash)} of these rows ({names}); pass --replace-rows to "
                "replace them, --resume to keep them and compute the rest, or give another --out")


def check_fingerprints(rows: list[dict], where: str) -> None:
    """ResultMergeError where rows of one model name (or of the held-out set) carry different fingerprints."""
    seen: dict[tuple, str] = {}
    for r in rows:
        p = r.get("provenance") or {}
        for key, fp in ((("held-out set",), p.get("heldout")), (("model", r["model"]), p.get("model"))):
            if fp and seen.setdefault(key, fp) != fp:
                raise ResultMergeError(f"{where} hold rows of the {' '.join(key)} measured on different files "
                                       f"(fingerprint {seen[key]} vs {fp}): they cannot share one table")


def check_provenance(old: list[dict], provenance: dict, out_dir: str) -> None:
    """ResultMergeError where a row of `old` was measured on held-out files, or on a checkpoint named as one of this
    run's models, whose fingerprint differs from this run's. Rows without fingerprints pass (matched by name)."""
    for r in old:
        p = r.get("provenance") or {}
        if p.get("heldout") and p["heldout"] != provenance["heldout"]:
            raise ResultMergeError(
                f"{out_dir}/accuracy.json holds rows measured on held-out files named {data_of(r).get('heldout')!r} "
                f"whose contents differ from this run's (fingerprint {p['heldout']} vs {provenance['heldout']}): give "
                "another --out, or --overwrite to replace the file")
        mine = provenance["models"].get(r["model"])
        if p.get("model") and mine is not None and p["model"] != mine:
            raise ResultMergeError(
                f"{out_dir}/accuracy.json holds rows of a model named {r['model']!r} whose checkpoint differs from "
                f"this run's (fingerprint {p['model']} vs {mine}): give another --out, name the checkpoint's directory "
                "apart, or --overwrite to replace the file")


def drop_repeated_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """`new` without the rows that repeat one of `old`: a row that reads no calibration data (its setup names none),
    of the same identity and the same bits per byte (within 1e-6) and retrieval, as two runs that differ only in their
    calibration settings both measure their baselines."""
    have = {row_key(r): r for r in old}

    def repeated(r) -> bool:
        o = have.get(row_key(r))
        if o is None or any(k in setup_of(r) for k in CALIB_KEYS):
            return False
        same_bpb = abs(o["bits_per_byte"] - r["bits_per_byte"]) <= 1e-6 * abs(o["bits_per_byte"])
        acc = lambda x: {L: v.get("accuracy") for L, v in x["retrieval"].items()}  # noqa: E731
        return same_bpb and acc(o) == acc(r)

    return [r for r in new if not repeated(r)]


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of `new` replace rows of `old` with the same identity (row_key); sorted for the table."""
    keyed = {row_key(r): r for r in old}
    for r in new:
        keyed[row_key(r)] = r
    return sorted(keyed.values(), key=_sort_key)


def relative(rows: list[dict]) -> list[dict]:
    """Adds bpb_increase_pct (against the BF16 row of the same model on identical perplexity data, else
    None), retrieval_delta_points (against a BF16 row on identical data, perplexity and retrieval; absent
    otherwise) with retrieval_delta_ci, its 95 % paired interval in points where both rows kept their
    per-sample outcomes (``intervals.paired_difference``), and compression_vs_bf16."""
    by_ppl: dict[tuple, dict] = {}
    by_all: dict[tuple, dict] = {}
    for r in rows:
        if r["method"] == "bf16":
            by_ppl.setdefault((r["model"], ppl_data_of(r)), r)
            by_all[(r["model"], json.dumps(data_of(r), sort_keys=True))] = r
    for r in rows:
        r.pop("bpb_increase_pct", None)
        r.pop("retrieval_delta_points", None)
        r.pop("retrieval_delta_ci", None)
        b = by_ppl.get((r["model"], ppl_data_of(r)))
        r["bpb_increase_pct"] = None if b is None else 100.0 * (r["bits_per_byte"] / b["bits_per_byte"] - 1.0)
        b = by_all.get((r["model"], json.dumps(data_of(r), sort_keys=True)))
        if b is not None:
            r["retrieval_delta_points"] = {L: 100.0 * (v["accuracy"] - b["retrieval"][L]["accuracy"])
                                           for L, v in r["retrieval"].items() if L in b["retrieval"]}
            paired = {L: paired_difference(v["per_sample"], b["retrieval"][L]["per_sample"])
                      for L, v in r["retrieval"].items()
                      if v.get("per_sample") and (b["retrieval"].get(L) or {}).get("per_sample")
                      and len(v["per_sample"]) == len(b["retrieval"][L]["per_sample"])}
            if paired and r is not b:
                r["retrieval_delta_ci"] = {L: [100.0 * lo, 100.0 * hi] for L, (_, lo, hi) in paired.items()}
        if r.get("bf16_bytes_per_token"):
            r["compression_vs_bf16"] = r["bf16_bytes_per_token"] / r["bytes_per_token"]
    return rows


def _fmt_bytes(b: float) -> str:
    return f"{b:.0f}" if abs(b - round(b)) < 1e-9 else f"{b:.1f}"


def _fmt_pct(x) -> str:
    return "—" if x is None else f"{x:+.2f}%"


def _fmt_retrieval(v) -> str:
    """'97.5 (n=200)', with its 95 % Wilson interval where the row kept the count of correct samples."""
    if v is None:
        return "—"
    if v.get("correct") is None:
        return f"{100 * v['accuracy']:.1f} (n={v['n']})"
    lo, hi = wilson(v["correct"], v["n"])
    return f"{100 * v['accuracy']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] (n={v['n']})"


def _len_name(L) -> str:
    L = int(L)
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def _setup_name(s: dict) -> str:
    if not s:
        return "—"
    g = "/".join(f"g{s[k]}" if s.get(k) else "—" for k in ("content_group", "rope_group"))
    return (g + (f", clip {s['content_clip']:g}" if s.get("content_clip") else "")
            + (f", RoPE ch/{s['rope_block']}" if s.get("rope_block") else "")
            + (f", KIVI block {s['kivi_block']}" if s.get("kivi_block") else "")
            + (f", {s['fp_window']} fp" if s.get("fp_window") else "")
            + (f", calib {s['calib_rows']} x {s['calib_len']}" if s.get("calib_len") else ""))


def markdown(rows: list[dict], claim_lines=None) -> str:
    """The table of one result file: a section per model, BF16 first, every row with its bytes per token,
    then the sentences ``claim_lines(rows)`` computes from the same rows (``claims.claim_lines``, which
    the eval command passes)."""
    for r in rows:
        check_row(r)
    rows = relative(sorted([dict(r) for r in rows], key=_sort_key))
    datas = []
    for r in rows:
        if data_of(r) not in datas:
            datas.append(data_of(r))
    lengths = sorted({int(L) for r in rows for L in r["retrieval"]})
    line_lengths = sorted({int(L) for r in rows for L in (r.get("retrieval_line") or {})})
    out = ["# Accuracy under a quantized MLA cache", "",
           f"Evaluation mode: **{EVAL_MODE}**: every attention read, the prefill's included, goes through the "
           "quantized cache, as a token-by-token decode would see it. The `setup` column gives the channel groups "
           "(content/RoPE) and the full-precision window (the newest tokens kept unquantized, the same for every "
           "method of a setup; none unless stated)."]
    if any(r["eval_mode"] != EVAL_MODE for r in rows):
        out.append("Rows marked † keep KIVI's residual (the newest RoPE keys of an unfinished block) at full precision.")
    if any(read_in_one_forward(r) for r in rows):
        out.append("Rows marked ‡ were measured with one forward a chunk, which reads a full-precision window or "
                   "per-channel RoPE blocks otherwise than decode steps do: every query read only the chunk's last "
                   "tokens unquantized, and a block quantized over the chunk's later tokens too "
                   "(`quantmla.evaluation.decode_reads`; rows written since read the cache as decode steps do).")
    mixed = len(datas) > 1
    if len(datas) == 1:
        out += ["", "Data: " + ", ".join(f"{k} {v}" for k, v in datas[0].items()) + "."]
    elif mixed:
        out += ["", "This file holds rows of several data settings (the `run` column names each row's). Bits per "
                "byte are compared across rows only on identical perplexity data, retrieval only on identical "
                "data; a new run cannot add rows to such a file."]
        out += [f"- settings {chr(65 + i)}: " + ", ".join(f"{k} {v}" for k, v in d.items()) for i, d in enumerate(datas)]
    out += ["", "Bits per byte (bpb) of held-out text (lower is better; Δ vs the model's BF16 row on the same data). "
            "Retrieval (key): the exact greedy answer of a `<key> =` lookup buried in held-out code, the query form "
            "the models were trained on, at each total length. Bytes/token: per token per MLA layer, codes + scales "
            "+ zero points (KIVI: per-channel block metadata amortized over the block)."]
    if line_lengths:
        out.append("Line recall (a format the models never trained on): complete the second half of a unique line "
                   "of held-out code that appeared earlier in the context, from its first half; in brackets the "
                   "control, the same prompt with the earlier line removed (chance level).")
    for model in sorted({r["model"] for r in rows}):
        R = [r for r in rows if r["model"] == model]
        out += ["", f"## {model}", ""]
        head = (["config", "setup", "method", "B/token", "bpb", "Δ bpb"] + [f"key {_len_name(L)}" for L in lengths]
                + [f"line {_len_name(L)} (ctrl)" for L in line_lengths] + (["run"] if mixed else []))
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|")
        for r in R:
            mark = (" †" if r["eval_mode"] != EVAL_MODE else "") + (" ‡" if read_in_one_forward(r) else "")
            cells = [r["config"], _setup_name(setup_of(r)), r["method"] + mark, _fmt_bytes(r["bytes_per_token"]),
                     f"{r['bits_per_byte']:.4f}", "—" if r["method"] == "bf16" else _fmt_pct(r.get("bpb_increase_pct"))]
            for L in lengths:
                cells.append(_fmt_retrieval(r["retrieval"].get(str(L))))
            for L in line_lengths:
                v = (r.get("retrieval_line") or {}).get(str(L))
                cells.append("—" if v is None else f"{100 * v['accuracy']:.1f} ({100 * v['control_accuracy']:.1f}), n={v['n']}")
            if mixed:
                cells.append(f"{chr(65 + datas.index(data_of(r)))}, {r.get('device', '?')}")
            out.append("| " + " | ".join(cells) + " |")
        paired = [r for r in R if r.get("retrieval_delta_ci")]
        if paired:
            out += ["", "Retrieval against BF16 on the same samples: Δ points with the 95 % paired interval "
                    "(Newcombe's hybrid score; an interval that holds 0 separates nothing)", ""]
            for r in paired:
                ci = r["retrieval_delta_ci"]
                parts = [f"{_len_name(L)} {r['retrieval_delta_points'][L]:+.1f} [{ci[L][0]:+.1f}, {ci[L][1]:+.1f}]"
                         for L in sorted(ci, key=int)]
                out.append(f"- {r['config']} {_setup_name(setup_of(r))} {r['method']}: " + "; ".join(parts))
    claims = claim_lines(rows) if claim_lines else []
    if claims:
        out += ["", "## What the table shows", "", *claims]
    out += ["", "Methods: " + "; ".join(f"`{k}` {v}" for k, v in METHODS.items()) + "."]
    return "\n".join(out) + "\n"


def write(rows: list[dict], out_dir: str, base: list[dict] | None = None, claim_lines=None) -> tuple[str, str]:
    """Write `base` (rows already checked by check_merge) with `rows` merged in to <out_dir>/accuracy.json
    and accuracy.md (with the sentences of `claim_lines`, see :func:`markdown`); returns both paths.
    Refuses rows of mixed data settings."""
    for r in rows:
        check_row(r)
    allrows = relative(merge_rows(list(base or []), rows))
    if rows:
        data = check_same_data(allrows, "the rows to write")
    else:  # a rewrite of a file: one written under older rules may hold several data settings
        datas = {json.dumps(data_of(r), sort_keys=True) for r in allrows}
        data = json.loads(datas.pop()) if len(datas) == 1 else None
    os.makedirs(out_dir, exist_ok=True)
    jpath, mpath = os.path.join(out_dir, "accuracy.json"), os.path.join(out_dir, "accuracy.md")
    doc = {"eval_mode": EVAL_MODE, "data": data, "rows": pack_samples(allrows)}
    for path, text in ((jpath, jsonfile.dumps(jsonfile.strict(doc)) + "\n"), (mpath, markdown(allrows, claim_lines))):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return jpath, mpath


