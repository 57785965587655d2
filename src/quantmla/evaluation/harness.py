"""The accuracy harness: any (model directory, cache config, method) -> one table row.

A *config* is the cache format (what is stored per token); a *method* is how the model and the cache
are prepared for it:

    bf16              the reference: the cache stored in bf16 (2 bytes a value), no quantization
    rtn               round to nearest, no transform
    hadamard          Hadamard rotation of the content path (calibration API, method="hadamard")
    quantmla          learned transforms of both paths (calibration API, method="quantmla")
    quantmla-content  ablation: QuantMLA's transform on the content path only (paths=("content",))
    quantmla-rope     ablation: QuantMLA's transform on the RoPE path only (paths=("rope",))
    kivi              no transform; the RoPE key per channel over blocks of tokens (cache.kivi)
    quantmla-rope-channel
                      QuantMLA's calibrated model (content transform, pair transform and centring:
                      the quantmla row's model), the RoPE key stored per channel per page of 64
                      tokens (cache.rope_channel: the scales fold into the query once per page)
    quantmla-rope-channel-pagefit
                      ablation: the same cache, the RoPE path fitted for that grouping instead of
                      per-token groups (calibration option rope_page)
    quantmla-content-rope-channel
                      ablation: QuantMLA's content transform only, the RoPE key untransformed and
                      uncentred, per channel per page (the KIVI grouping at the page size)

Every figure is measured with every attention read going through the quantized cache, prefill
included (EVAL_MODE). A row's `fp_window` keeps its newest tokens unquantized, the same for every
method (none by default); KIVI's unfinished block (< block tokens) is quantized per channel over the
tokens it holds unless the window covers it, so no method gets full-precision tokens the others lack.
Cache formats are named by CONTENT/ROPE bits, by MIX<a>/ROPE (content bits per layer; MIX<a>@g<G>/ROPE:
the INT4 layers' content at group G) or by a preset (PRESETS: "BF16", "FP8" — DeepSeek's fp8_ds_mla
layout); a preset added there runs in every grid under its name. The configurations live in evaluation/configs.py.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache, QuantMLALayer
from quantmla.cache.kivi import KIVICache, KIVIFormat, KIVILayout
from quantmla.cache.layout import DEFAULT_PAGE_SIZE, CacheFormat
from quantmla.cache.rope_channel import RopeChannelCache, RopeChannelFormat, RopeChannelLayout
from quantmla.errors import QuantMLAError
from quantmla.evaluation.configs import CacheConfig, named_config
from quantmla.corpus.calibration_text import calibration_texts
from quantmla.corpus.datasets import RETRIEVAL_LENGTHS
from quantmla.model.spec import MLASpec, load_spec
from quantmla.quant.format import BF16

EVAL_MODE = "every read quantized incl. prefill"
READS = "decode"  # a row's `reads`: every query read the cache as a decode step reads it (evaluation.decode_reads)

METHODS = {
    "bf16": "BF16 reference: the cache stored in bf16, no quantization",
    "rtn": "round to nearest, no transform",
    "hadamard": "Hadamard rotation of the content path (QuaRot point)",
    "quantmla": "QuantMLA: learned content + RoPE transforms",
    "quantmla-content": "ablation: QuantMLA transform on the content path only",
    "quantmla-rope": "ablation: QuantMLA transform on the RoPE path only",
    "kivi": "KIVI-style per-channel RoPE keys (blocks of tokens), no transform",
    "quantmla-rope-channel": "QuantMLA transforms of both paths, RoPE keys per channel per page (scales folded into the query)",
    "quantmla-rope-channel-pagefit": "ablation: quantmla-rope-channel with the RoPE transform fitted for the per-page grouping",
    "quantmla-content-rope-channel": "ablation: QuantMLA content transform, untransformed RoPE keys per channel per page",
}
# RoPE path per channel per page (cache.rope_channel); PAGE_FITTED: calibrated for that grouping (rope_page)
ROPE_CHANNEL = ("quantmla-rope-channel", "quantmla-rope-channel-pagefit", "quantmla-content-rope-channel")
PAGE_FITTED = ("quantmla-rope-channel-pagefit",)
CALIBRATED = {"hadamard": ("hadamard", ("content",)), "quantmla": ("quantmla", ("content", "rope")),
              "quantmla-content": ("quantmla", ("content",)), "quantmla-rope": ("quantmla", ("rope",)),
              "quantmla-rope-channel": ("quantmla", ("content", "rope")),
              "quantmla-rope-channel-pagefit": ("quantmla", ("content", "rope")),
              "quantmla-content-rope-channel": ("quantmla", ("content",))}


# -- cache configurations: evaluation/configs.py ----------------------------------------------------

class _BF16Layer(QuantMLALayer):
    """An unquantized MLA cache layer that stores (and so reads back) its inputs rounded to bf16."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(key_states.to(torch.bfloat16).to(key_states.dtype),
                              value_states.to(torch.bfloat16).to(value_states.dtype), *args, **kwargs)


def bf16_cache(model) -> QuantMLACache:
    """The BF16 reference cache: (c, k_R) stored as bf16, whatever the compute dtype."""
    cache = QuantMLACache(model, QuantCacheConfig(content=BF16, rope=BF16, method="bf16"))
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, QuantMLALayer):
            cache.layers[i] = _BF16Layer(layer.fmt, layer.d_c, layer.d_r, 0, layer.layer_idx)
    return cache


# -- rows ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSpec:
    """One table row to compute: a cache config under a method (kivi_block: KIVI's token block;
    rope_page: the page of tokens whose RoPE channels share a scale, ROPE_CHANNEL methods)."""

    config: CacheConfig
    method: str
    kivi_block: int = 32
    fp_window: int = 0  # the newest tokens every method keeps unquantized (BF16 rows: none needed)
    rope_page: int = DEFAULT_PAGE_SIZE

    def __post_init__(self):
        if self.method not in METHODS:
            raise QuantMLAError(f"unknown method {self.method!r}; use one of {sorted(METHODS)}")
        if self.method == "bf16" and self.config.quantized:
            raise QuantMLAError(f"method bf16 is the unquantized reference; it cannot run config {self.config.name}")
        if self.method != "bf16" and not self.config.quantized:
            raise QuantMLAError(f"config {self.config.name} quantizes nothing; use method bf16")
        if self.method == "kivi" and not (self.config.rope.quantized and self.config.rope.mode != "fp8"):
            raise QuantMLAError("the KIVI baseline needs an integer RoPE format (e.g. INT4/INT4)")
        if self.method in ROPE_CHANNEL and not (self.config.rope.quantized and self.config.rope.mode != "fp8"):
            raise QuantMLAError(f"method {self.method} stores integer RoPE codes per channel; it needs an integer "
                                "RoPE format (e.g. INT4/INT4)")
        if self.config.mix and self.method in ("kivi", "bf16"):
            raise QuantMLAError(f"config {self.config.name} sets content bits per layer; method {self.method} "
                                "stores one format for every layer (use rtn, hadamard or a quantmla method)")
        if self.fp_window < 0:
            raise QuantMLAError(f"the full-precision window must be >= 0 tokens, got {self.fp_window}")

    @property
    def key(self) -> tuple[str, str]:
        return (self.config.name, self.method)

    def kivi_format(self) -> KIVIFormat:
        return KIVIFormat(self.config.content, self.config.rope.bits, self.kivi_block, self.config.rope.mode,
                          self.config.rope.meta_dtype, fp_residual=False)

    def rope_channel_format(self) -> RopeChannelFormat:
        """The RoPE path of a ROPE_CHANNEL row: the config's RoPE bits, mode and meta dtype, per channel
        per page of `rope_page` tokens (the config's per-token RoPE group is what calibration fits for)."""
        r = self.config.rope
        return RopeChannelFormat(r.bits, self.rope_page, r.mode, r.meta_dtype)

    def bytes_per_token(self, spec: MLASpec, quant: QuantCacheConfig | None = None) -> float:
        """Per token per MLA layer: codes + scales + zero points (KIVI: block metadata amortized;
        ROPE_CHANNEL: page metadata amortized over the page). A mix counts the layers `quant` allocates to
        its wider content, or without `quant` the nominal share of its average bits."""
        share = None if quant is None else self.config.high_share_of(quant, spec.mla_layers)
        if self.method == "kivi":
            return KIVILayout(spec.d_c, spec.d_r, self.kivi_format()).bytes_per_token
        if self.method in ROPE_CHANNEL:
            per_channel = RopeChannelLayout(spec.d_c, spec.d_r, self.config.content, self.rope_channel_format())
            return per_channel.bytes_per_token + self.config.mix_extra_bytes(spec.d_c, share)
        return self.config.bytes_per_token(spec.d_c, spec.d_r, share)

    def cache_factory(self, quant: QuantCacheConfig | None = None) -> Callable | None:
        """model -> a fresh transformers Cache."""
        if self.method == "bf16":
            return bf16_cache
        if self.method == "kivi":
            fmt, window = self.kivi_format(), self.fp_window
            return lambda model: KIVICache(model, fmt, fp_window=window)
        q = replace(quant or self.config.quant(self.method), fp_window=self.fp_window)
        if self.method in ROPE_CHANNEL:
            rfmt = self.rope_channel_format()
            return lambda model: RopeChannelCache(model, q, rfmt)
        return lambda model: QuantMLACache(model, q)

    def describe(self) -> str:
        if self.method == "kivi":
            d = self.kivi_format().describe()
        elif self.method in ROPE_CHANNEL:
            d = f"content {self.config.content.describe()} + RoPE {self.rope_channel_format().describe()}"
            if self.config.mix:
                d += self.config.describe()[len(CacheFormat(self.config.content, self.config.rope).describe()):]
        else:
            d = self.config.describe()
        return d + (f", newest {self.fp_window} tokens unquantized" if self.fp_window and self.method != "bf16" else "")


def default_rows(content_group: int = 64, rope_group: int = 32, quick: bool = False) -> list[RowSpec]:
    """The accuracy table's grid: BF16, FP8, content-only / RoPE-only INT4 (RTN), and for INT4/INT4 and
    INT2/INT4 every baseline, QuantMLA and its ablations, and QuantMLA with RoPE keys per channel per
    page (it reads the QuantMLA row's calibration). quick: a CI-sized subset."""
    cfg = lambda n: named_config(n, content_group, rope_group)  # noqa: E731
    rows = [RowSpec(cfg("BF16"), "bf16"), RowSpec(cfg("FP8"), "rtn")]
    if quick:
        return rows + [RowSpec(cfg("INT4/INT4"), m) for m in ("rtn", "kivi", "hadamard", "quantmla")]
    rows += [RowSpec(cfg("INT4/BF16"), "rtn"), RowSpec(cfg("BF16/INT4"), "rtn")]
    for name in ("INT4/INT4", "INT2/INT4"):
        rows += [RowSpec(cfg(name), m, kivi_block=rope_group)
                 for m in ("rtn", "kivi", "hadamard", "quantmla-content", "quantmla-rope", "quantmla",
                           "quantmla-rope-channel")]
    return rows


# -- data -------------------------------------------------------------------------------------------


@dataclass
class EvalData:
    """Held-out material of one model: perplexity chunks [N, L] and retrieval samples per length,
    plus calibration ids [N, L] drawn from *training* text (never from the held-out split)."""

    ppl: torch.Tensor | list
    retrieval: dict[int, list[dict]] = field(default_factory=dict)
    line: dict[int, list[dict]] = field(default_factory=dict)  # line-recall samples per length (line_recall.py)
    calib_ids: torch.Tensor | None = None
    seq_len: int = 512
    source: str = ""


def load_eval_data(tokenizer, *, heldout_root: str | None = None, seq_len: int = 512, ppl_chunks: int | None = None,
                   retrieval_n: int | None = None, lengths: Iterable[int] = RETRIEVAL_LENGTHS, kind: str = "code",
                   calib_n: int = 16, calib_len: int | None = None, formats: Iterable[str] = ("key",),
                   seed: int = 0) -> EvalData:
    """The shipped held-out sets (:mod:`quantmla.corpus.datasets`): `kind` ("code" or "prose")
    documents cut into `ppl_chunks` chunks of `seq_len` tokens, `retrieval_n` retrieval samples per
    length and format (`formats`: "key" the shipped key lookups, "line" line recall built from the
    held-out code), and `calib_n` calibration rows of `calib_len` tokens from training text.
    Raises QuantMLAError when the held-out set cannot give what is asked (never a smaller set)."""
    from quantmla.corpus import datasets as DS
    from quantmla.corpus.chunks import token_chunks

    root = DS.heldout_root(heldout_root)
    if not (root / f"{kind}.jsonl").exists():
        raise FileNotFoundError(f"no held-out set at {root / f'{kind}.jsonl'}; the reference models ship it under "
                                "models/heldout (set QUANTMLA_MODELS or --heldout)")
    ppl = token_chunks(tokenizer, DS.load_texts(kind, root), seq_len, max_chunks=ppl_chunks)
    if ppl_chunks is not None and (ppl.shape[0] < ppl_chunks or ppl.shape[1] != seq_len):
        raise QuantMLAError(f"the held-out {kind} text gives {ppl.shape[0]} chunks of {ppl.shape[1]} tokens, "
                            f"--ppl-chunks {ppl_chunks} x --seq-len {seq_len} asked; ask for fewer or shorter chunks")
    retr, line = {}, {}
    for L in lengths:
        if "key" in formats:
            if not (root / f"retrieval_{L}.jsonl.xz").exists():
                raise QuantMLAError(f"no key-retrieval samples of {L} tokens under {root}; use --lengths from "
                                    f"{', '.join(map(str, DS.retrieval_lengths(root)))}")
            retr[int(L)] = DS.load_retrieval(L, root, limit=retrieval_n)
            if retrieval_n is not None and len(retr[int(L)]) < retrieval_n:
                raise QuantMLAError(f"{root} holds {len(retr[int(L)])} key-retrieval samples of {L} tokens, "
                                    f"--retrieval-n {retrieval_n} asked; ask for at most {len(retr[int(L)])}")
        if "line" in formats:
            from quantmla.evaluation.line_recall import make_line_samples

            line[int(L)] = make_line_samples(tokenizer, DS.load_texts("code", root), int(L), retrieval_n or 100, seed)
            if len(line[int(L)]) < (retrieval_n or 100):
                raise QuantMLAError(f"the held-out code gives only {len(line[int(L)])} line-recall samples of {L} "
                                    f"tokens; ask for at most that many (--retrieval-n)")
    calib = None
    if calib_n:
        cl = calib_len or seq_len
        calib = token_chunks(tokenizer, calibration_texts(heldout_root=str(root)), cl, max_chunks=calib_n)
        if calib.shape[0] < calib_n or calib.shape[1] != cl:
            raise QuantMLAError(f"calibration text gave only {tuple(calib.shape)} token rows, wanted {calib_n} x {cl}")
    return EvalData(ppl=ppl, retrieval=retr, line=line, calib_ids=calib, seq_len=seq_len, source=str(root))


# -- evaluation --------------------------------------------------------------------------------------


def _ppl_fn():
    from quantmla.evaluation.perplexity import bits_per_byte

    return bits_per_byte


def _retrieval_fn():
    from quantmla.evaluation.retrieval import retrieval_accuracy

    return retrieval_accuracy


def calibration_api():
    """The calibration entry point ``calibrate(model, calib_ids, quant, *, method, paths, seed, ...)``."""
    from quantmla.calibration import calibrate

    return calibrate


def prepare(model, row: RowSpec, calib_ids: torch.Tensor | None, seed: int = 0, calibrate_fn=None,
            calib_kwargs: dict | None = None) -> tuple[QuantCacheConfig | None, dict | None]:
    """Prepare `model` in place for `row` (calibrate when the method needs it).
    Returns (the QuantCacheConfig the cache uses, the calibration report or None)."""
    if row.config.mix and calib_ids is None:
        raise QuantMLAError(f"config {row.config.name} chooses content bits per layer from calibration data (calib_ids)")
    mixed = row.config.overrides(model, calib_ids, seed) if row.config.mix else {}
    if row.method not in CALIBRATED:
        if row.method in ("bf16", "kivi"):
            return None, None
        return replace(row.config.quant(row.method), layer_overrides=mixed), None
    if calib_ids is None:
        raise QuantMLAError(f"method {row.method} needs calibration data (calib_ids)")
    if calibrate_fn is None:
        calibrate_fn = calibration_api()
    algo, paths = CALIBRATED[row.method]
    quant = replace(row.config.quant(row.method), layer_overrides=mixed)
    kw = dict(calib_kwargs or {})
    if row.method in PAGE_FITTED:
        kw["rope_page"] = row.rope_page
    try:  # pass only the options this calibration API takes
        import inspect

        params = inspect.signature(calibrate_fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kw = {k: v for k, v in kw.items() if k in params}
    except (TypeError, ValueError):
        pass
    report = calibrate_fn(model, calib_ids, quant, method=algo, paths=paths, seed=seed, **kw)
    qc = QuantCacheConfig.from_model_config(model.config) or quant
    if (qc.content, qc.rope) != (quant.content, quant.rope):
        raise QuantMLAError(f"calibration recorded {qc.describe()} but row {row.config.name} evaluates {quant.describe()}")
    return qc, report


def calibration_key(row: RowSpec) -> tuple:
    """What a row's calibrated model depends on: its formats, the calibration (CALIBRATED) and, for
    PAGE_FITTED methods, the page the RoPE path was fitted for. Rows with equal keys share one model."""
    return (row.config, CALIBRATED.get(row.method, row.method), row.rope_page if row.method in PAGE_FITTED else 0)


def evaluate_row(model, tokenizer, row: RowSpec, data: EvalData, *, spec: MLASpec | None = None, seed: int = 0,
                 ppl_fn=None, retrieval_fn=None, calibrate_fn=None, calib_kwargs: dict | None = None,
                 progress: Callable[[str], None] | None = None, prepared: dict | None = None) -> dict:
    """Prepare a *copy* of `model` for `row`, then measure bits per byte and retrieval accuracy.
    `prepared`: a dict kept across rows of one model; calibrated models are stored there by (config,
    calibration: :func:`calibration_key`) and reused by rows that differ only in their full-precision
    window or in how the cache stores what the same calibration produced (quantmla and
    quantmla-rope-channel read one calibrated model)."""
    spec = spec or load_spec(model)
    ppl_fn = ppl_fn or _ppl_fn()
    retrieval_fn = retrieval_fn or _retrieval_fn()
    t0 = time.time()
    key = calibration_key(row)
    if prepared is not None and key in prepared:
        m, quant, report = prepared[key]
    else:
        m = copy.deepcopy(model) if row.method in CALIBRATED else model
        quant, report = prepare(m, row, data.calib_ids, seed, calibrate_fn, calib_kwargs)
        if prepared is not None and row.method in CALIBRATED:
            prepared[key] = (m, quant, report)
    t_cal = time.time() - t0
    factory = row.cache_factory(quant)
    if progress:
        progress(f"{row.config.name} {row.method}: perplexity")
    t1 = time.time()
    ppl = ppl_fn(m, tokenizer, data.ppl, seq_len=data.seq_len, cache_factory=factory)
    retr = {}
    for L, samples in sorted(data.retrieval.items()):
        if progress:
            progress(f"{row.config.name} {row.method}: retrieval {L}")
        r = retrieval_fn(m, tokenizer, samples, cache_factory=factory)
        retr[str(L)] = {"accuracy": r["accuracy"], "n": r["n"], "correct": r.get("correct"),
                        "per_sample": [bool(x) for x in r.get("per_sample", [])] or None}
    line = {}
    for L, samples in sorted(data.line.items()):
        from quantmla.evaluation.line_recall import line_recall

        if progress:
            progress(f"{row.config.name} {row.method}: line recall {L}")
        line[str(L)] = line_recall(m, tokenizer, samples, cache_factory=factory, retrieval_fn=retrieval_fn)
    row_out = {
        "config": row.config.name,
        "method": row.method,
        "format": row.describe(),
        "bits_per_byte": ppl["bits_per_byte"],
        "perplexity_tokens": ppl.get("tokens"),
        "retrieval": retr,
        **({"retrieval_line": line} if line else {}),
        "bytes_per_token": row.bytes_per_token(spec, quant),
        **({"content_bits_by_slot": {str(s): quant.format_for(s).content.bits for s in spec.mla_layers},
            "content_format_by_slot": {str(s): quant.format_for(s).content.describe() for s in spec.mla_layers}}
           if row.config.mix and quant is not None else {}),
        "bf16_bytes_per_token": spec.bytes_per_token_bf16(),
        "eval_mode": EVAL_MODE,
        "reads": READS,
        "calibration_s": round(t_cal, 1) if row.method in CALIBRATED else None,
        "eval_s": round(time.time() - t1, 1),
    }
    lay = None
    if row.method == "kivi":
        lay = KIVILayout(spec.d_c, spec.d_r, row.kivi_format())
    elif row.method in ROPE_CHANNEL:
        lay = RopeChannelLayout(spec.d_c, spec.d_r, row.config.content, row.rope_channel_format())
    if lay is not None:
        extra = row.config.mix_extra_bytes(spec.d_c, row.config.high_share_of(quant, spec.mla_layers))
        row_out["bytes_per_token_at"] = {str(n): lay.bytes_per_token_at(n) + extra
                                         for n in (data.seq_len, *RETRIEVAL_LENGTHS)}
    if report is not None:
        row_out["calibration"] = _summarize_report(report)
    return row_out


def _summarize_report(report) -> dict:
    """A small JSON-able digest of what the calibration API returned: its scalar fields, its timings
    and, per layer, the held-out joint output error before (RTN) and after, and what was chosen."""
    if report is None:
        return {}
    if hasattr(report, "to_dict"):
        report = report.to_dict()
    elif hasattr(report, "__dataclass_fields__"):
        from dataclasses import asdict

        report = asdict(report)
    if not isinstance(report, dict):
        return {"report": str(report)[:500]}
    out = {k: v for k, v in report.items() if isinstance(v, (int, float, str, bool)) or v is None}
    if isinstance(report.get("seconds"), dict):
        out["seconds"] = {k: round(float(v), 1) for k, v in report["seconds"].items()}
    layers = []
    for L in report.get("layers", []) or []:
        if isinstance(L, dict):
            j = L.get("joint") or {}
            layers.append({"slot": L.get("slot"), "joint_before": j.get("before"), "joint_after": j.get("after"),
                           "content": (L.get("content") or {}).get("chosen"), "rope": (L.get("rope") or {}).get("chosen")})
    if layers:
        out["layers"] = layers
    return out


def read_in_one_forward(r: dict) -> bool:
    """Whether a stored row was measured with one forward a chunk where decode steps read the cache otherwise: rows
    written before `reads` (READS) with a full-precision window, KIVI-style RoPE blocks or per-channel RoPE pages.
    One forward kept only a chunk's last W tokens unquantized for every query, and quantized a block over the
    chunk's later tokens too (evaluation.decode_reads)."""
    if r.get("reads") == READS or r["method"] == "bf16":
        return False
    window = (r.get("setup") or {}).get("fp_window") or (r.get("data") or {}).get("fp_window") or 0
    return bool(window) or r["method"] == "kivi" or r["method"] in ROPE_CHANNEL
