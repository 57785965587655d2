"""``calibrate``: learn path-specific transforms per MLA layer, fuse them, record the cache config.

Layers are calibrated independently from one capture of full-precision activations (the
transforms keep the FP function, so every layer sees FP inputs either way). The calibration
sequences are split by sequence into a fit part and a held-out part; every reported "before" /
"after" figure is measured on the held-out part.

Methods: ``rtn`` (no transform), ``hadamard`` (the QuaRot point on the content path, RoPE
untouched), ``quantmla`` (learned content transform, searched RoPE pair scalars, each kept only
where it beats its alternatives on held-out data).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.calibration.capture import capture_calibration_data
from quantmla.calibration.content import content_fn, fit_content
from quantmla.calibration.objectives import OutputDistortion, RopeQK, rope_dequant, rope_page_dequant
from quantmla.calibration.options import METHODS, PATHS, CalibrationOptions
from quantmla.calibration.rope import fit_rope, rope_objective
from quantmla.errors import QuantMLAError
from quantmla.model.spec import load_spec, mla_modules
from quantmla.transforms.content import ContentTransform
from quantmla.transforms.fuse import LayerTransform, check_fusable, fuse_transforms
from quantmla.transforms.rope import RopeTransform, apply_pairs

__all__ = ["METHODS", "PATHS", "CalibrationOptions", "CalibrationReport", "LayerReport", "calibrate", "fit_layer"]


@dataclass
class LayerReport:
    slot: int
    content: dict = field(default_factory=dict)  # before/after/chosen/candidates (held-out relative output error)
    rope: dict = field(default_factory=dict)  # before/after/chosen/candidates (held-out positional QK error)
    joint: dict = field(default_factory=dict)  # both paths quantized: held-out relative output error
    transform: dict = field(default_factory=dict)
    rope_offset: list[float] | None = None  # the slot's RoPE key offset in cache channels (see centre_rope_keys)


@dataclass
class CalibrationReport:
    method: str
    paths: tuple[str, ...]
    seed: int
    quant: dict
    tokens: int
    fit_sequences: int
    heldout_sequences: int
    rope_weighting: str
    layers: list[LayerReport] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["paths"] = list(self.paths)
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self) -> str:
        rows = [(f"calibration: method={self.method} paths={','.join(self.paths)} seed={self.seed} "
                 f"tokens={self.tokens} (fit {self.fit_sequences} / held-out {self.heldout_sequences} sequences)"),
                "held-out objectives, before (RTN) -> after:",
                f"{'slot':>4}  {'content out-err':>24} {'chosen':>9}  {'RoPE QK-err':>24} {'chosen':>14}  {'joint out-err':>22}"]
        for l in self.layers:
            c = f"{l.content['before']:.4g} -> {l.content['after']:.4g}" if l.content else "-"
            r = f"{l.rope['before']:.4g} -> {l.rope['after']:.4g}" if l.rope else "-"
            rows.append(f"{l.slot:>4}  {c:>24} {l.content.get('chosen', '-'):>9}  {r:>24} {l.rope.get('chosen', '-'):>14}  "
                        f"{l.joint['before']:.4g} -> {l.joint['after']:.4g}")
        rows.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()))
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def split_sequences(n: int, heldout_fraction: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if n < 2:
        raise QuantMLAError(f"calibration needs at least 2 sequences (one is held out to select transforms), got {n}")
    n_held = min(n - 1, max(1, round(n * heldout_fraction)))
    perm = torch.randperm(n, generator=generator)
    return perm[n_held:].sort().values, perm[:n_held].sort().values


def check_formats(spec, quant: QuantCacheConfig, opts: CalibrationOptions | None = None,
                  seq_len: int | None = None) -> None:
    """The model caches a latent, `quant` is for this model (its layer overrides name its cache slots) and every
    layer's formats fit its d_c and d_r; with `opts.rope_page`, every quantized RoPE path can be stored per channel
    per page and the calibration rows (`seq_len` tokens) hold at least one page. Run before any capture."""
    if not isinstance(quant, QuantCacheConfig):
        raise QuantMLAError(f"quant must be a QuantCacheConfig, got {type(quant).__name__}")
    spec.require_latent_cache()
    quant.check_model(spec)
    for slot in spec.mla_layers:
        f = quant.format_for(slot)
        f.content.check_dim(spec.d_c, f"content path of layer {slot}")
        f.rope.check_dim(spec.d_r, f"RoPE path of layer {slot}")
        if opts is not None and opts.rope_page and f.rope.quantized:
            from quantmla.cache.rope_channel import RopeChannelFormat

            RopeChannelFormat(f.rope.bits, opts.rope_page, f.rope.mode, f.rope.meta_dtype)  # FP8 RoPE: refused here
    if opts is not None and opts.rope_page and seq_len is not None and seq_len < opts.rope_page:
        raise QuantMLAError(f"rope_page {opts.rope_page}: the calibration rows hold {seq_len} tokens, not one whole "
                            "page, so the RoPE path would be fitted on nothing; give longer rows or a smaller page")


def rope_centring(quant: QuantCacheConfig, slots, *, method: str, paths, rope_center: bool) -> bool:
    """Whether a calibration with these options centres the RoPE keys: method quantmla, the RoPE
    path among `paths` and quantized in some slot, and `rope_center`. Its checkpoint then lists every
    fitted slot under rope_offsets; otherwise it is marked ``"rope_centring": false`` and carries none."""
    return bool(rope_center) and method == "quantmla" and "rope" in paths and \
        any(quant.format_for(s).rope.quantized for s in slots)


def slot_offsets(fitted: dict[int, list[float] | tuple[float, ...]], slots, centred: bool) -> dict:
    """The checkpoint's rope_offsets (``QuantCacheConfig.rope_offsets``): every slot's fitted offset
    [d_r], None for a slot where centring did not beat plain RTN on held-out keys (stored uncentred),
    and no entry at all when the calibration did not centre (written as ``"rope_centring": false``)."""
    if not centred:
        return {}
    return {int(s): (tuple(float(x) for x in fitted[int(s)]) if int(s) in fitted else None) for s in sorted(slots)}


def centre_rope_keys(d, fit_seqs: torch.Tensor, context: int | None = None):
    """A copy of LayerData `d` whose RoPE keys (all of them, and the sampled ones) have the offset c
    removed; -> (copy, c [d_r]).

    Softmax is shift-invariant per query, so a constant key offset c changes no attention weight
    (every logit of query t moves by q_t·c); the cache stores k_R − c. MLA's RoPE keys carry a large
    common component in their low-frequency pairs, which per-token quantization otherwise spends its
    range on. The offset must serve every position of the context, not only the calibration rows'
    0 … L−1: per pair j the keys are de-rotated with the family's own phase (``d.rope_phase``), their
    mean m_j re-rotated and averaged over positions 0 … context−1,

        c_j = m_j · (1/context) Σ_s e^{iθ_j s},

    the mean key over the whole context (pairs that turn over it average to ~0; pairs that barely
    turn keep their mean). context: default ``d.max_positions``; 0, or without a phase, the plain mean."""
    import dataclasses as dc

    k = d.k_rope[fit_seqs.to(d.k_rope.device)].double()  # [n, L, d_r]
    L, d_r = k.shape[1], k.shape[2]
    context = d.max_positions if context is None else context
    phase = d.rope_phase
    if phase is None or not context or phase.shape[0] < min(L, 2):
        mu = k.reshape(-1, d_r).mean(0)
    else:
        w = phase[:L].to(k.device)  # [L, P]
        m = apply_pairs(k, w.conj(), d.rope_layout).reshape(-1, d_r).mean(0)  # de-rotated mean key [d_r]
        theta = torch.angle(phase[1]).to(k.device)  # radians per position, per pair
        s = torch.arange(max(int(context), L), device=k.device, dtype=torch.float64)
        avg = torch.polar(torch.ones_like(s)[:, None], s[:, None] * theta[None]).mean(0)  # [P]
        mu = apply_pairs(m[None], avg, d.rope_layout)[0]
    mu = mu.to(d.k_rope.dtype)
    return dc.replace(d, k_rope=d.k_rope - mu, keys=d.keys - mu.to(d.keys.device), key_ref=d.keys), mu


def spread_key_positions(d, generator: torch.Generator, context: int | None = None, fraction: float = 0.5):
    """A copy of LayerData `d` whose kept RoPE keys, with the queries that read them, sit at random
    positions of the model's context instead of the calibration rows' 0 … L−1.

    Moving a (query, key) configuration by Δ positions turns every pair by θ_j·Δ and changes no
    logit, so the RoPE objective's quadratic form follows: k ← R(Δ)·k, A ← R(Δ)·A·R(Δ)ᵀ. What changes
    is what the per-token quantizer sees: a slowly turning pair is met in all its orientations, as it
    will be at serving time, rather than in the one a 512-token row covers. Without a RoPE phase, or
    when the context is no longer than the rows, `d` itself."""
    import dataclasses as dc

    context = context or d.max_positions
    L = d.k_rope.shape[1]
    if d.rope_phase is None or context is None or context <= L:
        return d
    K = d.keys.shape[0]
    theta = torch.angle(d.rope_phase[1]).double()
    delta = torch.randint(0, int(context) - L, (K,), generator=generator).double()
    delta = delta * (torch.rand(K, generator=generator) < fraction).double()  # the others stay where they were
    turn = torch.polar(torch.ones(K, theta.numel(), dtype=torch.float64), delta[:, None] * theta[None])  # [K, P]
    turn = turn.to(d.keys.device)
    keys = apply_pairs(d.keys.double(), turn, d.rope_layout).to(d.keys.dtype)

    def both_sides(a):  # R·A·Rᵀ: turn every row, then every column
        a = apply_pairs(a.double(), turn[:, None], d.rope_layout).transpose(-1, -2)
        return apply_pairs(a, turn[:, None], d.rope_layout).transpose(-1, -2)

    A = {w: both_sides(a).to(a.dtype) for w, a in d.A.items()}
    return dc.replace(d, keys=keys, A=A)


def fit_layer(d, fmt, fit_seqs: torch.Tensor, held_seqs: torch.Tensor, opts: CalibrationOptions,
              pbar=None, timer=None) -> tuple[LayerTransform, LayerReport]:
    """One layer's calibration from its captured data `d` (a LayerData) and CacheFormat `fmt`:
    the transforms to fuse (identity paths left None) and the layer's report (held-out figures).
    This is the whole per-layer work of :func:`calibrate` (streamed calibration calls it too).
    timer: None, or a function of a path's name ("content", "rope") giving a context manager that
    the path's fit runs inside (what benchmarks time each fit with).

    opts.rope_center (method quantmla, RoPE path quantized): the RoPE keys are centred first (their
    mean over the model's context, estimated from the fit sequences, becomes the slot's cache offset,
    see :func:`centre_rope_keys`) and every fit, and the "after" figures, see the centred keys;
    "before" is plain RTN.

    opts.rope_page (> 0): the RoPE path is fitted, chosen and reported for keys stored per channel per
    page of that many tokens (``cache.rope_channel``) with the bits, mode and meta dtype of fmt.rope,
    instead of fmt.rope's per-token groups."""
    method, paths, seed, rope_weighting = opts.method, opts.paths, opts.seed, opts.rope_weighting
    page = None
    if opts.rope_page and fmt.rope.quantized:
        from quantmla.cache.rope_channel import RopeChannelFormat

        page = RopeChannelFormat(fmt.rope.bits, opts.rope_page, fmt.rope.mode, fmt.rope.meta_dtype)
    rope_spread = opts.rope_spread
    slot = d.slot
    mu = None
    if opts.rope_center and method == "quantmla" and "rope" in paths and fmt.rope.quantized:
        if rope_spread > 0:
            d = spread_key_positions(d, torch.Generator().manual_seed(seed * 1000003 + slot + 7), fraction=rope_spread)
        d_rtn = d  # the keys as they are: RTN's "before"
        d, mu = centre_rope_keys(d, fit_seqs, context=opts.rope_center_context)
    else:
        d_rtn = d
    lg = torch.Generator().manual_seed(seed * 1000003 + slot)
    rep = LayerReport(slot=slot)
    ct: ContentTransform | None = None
    rt: RopeTransform | None = None
    timer = timer or (lambda path: contextlib.nullcontext())
    if "content" in paths:
        with timer("content"):
            cf = fit_content(d, fmt.content, fit_seqs, held_seqs, method=method, steps=opts.steps, lr=opts.lr,
                             batch_size=opts.batch_size, generator=lg, pbar=pbar)
        rep.content = {"before": cf.heldout["rtn"], "after": cf.heldout[cf.chosen], "chosen": cf.chosen,
                       "candidates": cf.heldout, "train_curve": cf.curve}
        ct = None if cf.chosen == "rtn" else cf.transform
    if "rope" in paths:
        if method == "quantmla":
            with timer("rope"):
                rf = fit_rope(d, fmt.rope, fit_seqs, held_seqs, weighting=rope_weighting, searches=opts.rope_searches,
                              steps=opts.fitted_rope_steps, pbar=pbar, page=page)
            rt = None if rf.chosen == "rtn" else rf.transform
            cands, chosen, before = dict(rf.heldout), rf.chosen, rf.heldout["rtn"]
            if mu is not None:  # the fits saw centred keys; "before" is RTN on the keys as they are
                before = float(rope_objective(d_rtn, fmt.rope, held_seqs, rope_weighting, page)())
                # the fits' objectives are normalized by the uncentred keys' energy (key_ref), as `before` is
                cands = {f"{k}+centred": v for k, v in cands.items()} | {"rtn": before}
                chosen = f"{chosen}+centred"
                if cands[chosen] >= before:  # centring and fitting did not help on held-out keys: plain RTN
                    d, mu, rt, chosen = d_rtn, None, None, "rtn"
            rep.rope = {"before": before, "after": cands[chosen], "chosen": chosen,
                        "candidates": cands, "fit": rf.fit, "weighting": rope_weighting}
        else:
            held_m = torch.isin(d.key_seq, held_seqs.to(d.key_seq.device))
            v = float(RopeQK(d.keys[held_m], d.A[rope_weighting][held_m], fmt.rope, d.rope_layout)())
            rep.rope = {"before": v, "after": v, "chosen": "rtn", "weighting": rope_weighting}
    # both paths quantized, held-out output error: RTN vs the chosen transforms
    gamma = d.gamma.double().cpu()
    c_rtn = content_fn(ContentTransform.identity(gamma), gamma, fmt.content)
    c_new = content_fn(ct, gamma, fmt.content) if ct is not None else c_rtn
    z = None if rt is None else rt.z
    rep.joint = {
        "before": OutputDistortion(d_rtn, held_seqs)(c_rtn, lambda k: rope_dequant(k, None, fmt.rope, d.rope_layout)),
        "after": OutputDistortion(d, held_seqs)(c_new, lambda k: rope_dequant(k, z, fmt.rope, d.rope_layout)),
    }
    if page is not None:  # the RoPE path as it is stored: per channel per page, RTN and the chosen transforms
        rep.joint = {
            "before": OutputDistortion(d_rtn, held_seqs)(c_rtn, lambda k: rope_page_dequant(k, None, page, d.rope_layout)),
            "after": OutputDistortion(d, held_seqs)(c_new, lambda k: rope_page_dequant(k, z, page, d.rope_layout)),
            "rope_page": page.page_size,
        }
    if mu is not None:  # the offset in the cache's channels: the transformed mean key
        off = mu.double().cpu() if z is None else apply_pairs(mu.double().cpu()[None], z.cpu(), d.rope_layout)[0]
        rep.rope_offset = [float(x) for x in off]
    lt = LayerTransform(ct, rt)
    rep.transform = lt.summary()
    return lt, rep


def calibrate(
    model: torch.nn.Module,
    calib_ids: torch.Tensor,
    quant: QuantCacheConfig,
    options: CalibrationOptions | None = None,
    *,
    progress: bool = True,
    verbose: bool | None = None,
    **changes,
) -> CalibrationReport:
    """Calibrate `model` in place for the cache format `quant` and fuse the transforms.

    calib_ids: LongTensor [N, L] (N >= 2; a quarter of the sequences is held out). Sets
    ``model.config.quantization_config = quant.to_dict()`` with ``method`` recorded. Returns the
    per-layer held-out objectives before (RTN) and after. Deterministic for a given seed.
    options: a :class:`CalibrationOptions` (default: its defaults); keyword `changes` replace its
    fields (``calibrate(model, ids, quant, method="hadamard", steps=50)``). progress: progress bars;
    verbose: print the report table (default: as progress).
    """
    opts = CalibrationOptions.of(options, **changes).check()
    spec = load_spec(model)
    calib_ids = torch.as_tensor(calib_ids)
    check_formats(spec, quant, opts, calib_ids.shape[-1])
    if opts.method != "rtn":  # the transforms fuse into plain float weights only: known before any capture
        for slot, module in mla_modules(model).items():
            check_fusable(module, slot)
    verbose = progress if verbose is None else verbose
    method, paths, seed = opts.method, opts.paths, opts.seed
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(seed)  # every random choice below uses explicit generators
    fit_seqs, held_seqs = split_sequences(calib_ids.shape[0], opts.heldout_fraction, g)

    was_training = model.training
    model.eval()
    data = capture_calibration_data(model, spec, calib_ids, queries_per_seq=opts.queries_per_seq,
                                    rope_keys_per_seq=opts.rope_keys_per_seq, batch_size=opts.batch_size,
                                    max_bytes=opts.max_capture_bytes, seed=seed, progress=progress,
                                    store_device=opts.device)
    t_capture = time.perf_counter() - t0

    from tqdm.auto import tqdm

    learn_content = method == "quantmla" and "content" in paths
    total = len(data) * ((opts.steps if learn_content else 0) + (1 if method == "quantmla" and "rope" in paths else 0))
    pbar = tqdm(total=total, desc=f"calibrating ({method}, {len(data)} layers)", disable=not progress or total == 0,
                leave=False)
    transforms: dict[int, LayerTransform] = {}
    reports: list[LayerReport] = []
    try:
        for slot, d in data.items():
            transforms[slot], rep = fit_layer(d, quant.format_for(slot), fit_seqs, held_seqs, opts, pbar=pbar)
            reports.append(rep)
    finally:
        pbar.close()
    t_fit = time.perf_counter() - t0 - t_capture

    fuse_transforms(model, {k: v for k, v in transforms.items() if v.content is not None or v.rope is not None}, spec)
    centred = rope_centring(quant, list(data), method=method, paths=paths, rope_center=opts.rope_center)
    offsets = slot_offsets({r.slot: r.rope_offset for r in reports if r.rope_offset is not None}, list(data), centred)
    dataclasses.replace(quant, method=method, rope_offsets=offsets).attach(model)  # model.config.quantization_config
    model.train(was_training)
    report = CalibrationReport(
        method=method, paths=paths, seed=seed, quant=model.config.quantization_config, tokens=int(calib_ids.numel()),
        fit_sequences=len(fit_seqs), heldout_sequences=len(held_seqs), rope_weighting=opts.rope_weighting, layers=reports,
        seconds={"capture": t_capture, "fit": t_fit, "total": time.perf_counter() - t0},
    )
    if verbose:
        print(report.table())
    return report
