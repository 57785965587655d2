"""Run the dual-path error analysis on a model: capture FP activations, quantize each path of each
layer at each bit width, measure (see :mod:`quantmla.analysis.error_model`) and summarize."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from quantmla.analysis.error_model import (
    PATHS,
    LayerStats,
    LayerTensors,
    measure,
    pair_energies,
    pair_logit_error,
    path_formats,
    quantize_paths,
)
from quantmla.quant.format import INT_BITS
from quantmla.quant.groupwise import quantize_dequantize
from quantmla.errors import QuantMLAError
from quantmla.model.capture import capture_attention_inputs
from quantmla.model.spec import load_spec, mla_modules
from quantmla.model.view import MLAView

DEFINITIONS = {
    "distortion": "‖Δo‖/‖o‖ over all queries and sequences, o = the attention block's output after o_proj "
                  "(all output-space terms below are measured there too)",
    "distortion_heads": "the same in per-head value space (before o_proj)",
    "matching": "‖Σ_t Δp(t)·(v+v̂)/2‖/‖o‖ — exact matching term (probability change)",
    "aggregation": "‖Σ_t (p+p̂)/2·e_c(t)W_UV‖/‖o‖ — exact aggregation term (value error); matching+aggregation = Δo exactly",
    "cross": "‖Σ_t Δp(t)·e_c(t)W_UV‖/‖o‖ — the second-order term, split half/half into the two above",
    "first_order_rel_err": "‖Δo¹ − Δo‖/‖Δo‖, Δo¹ = docs/design.md §2 first-order model with exact logit error",
    "content_rel_err / rope_rel_err": "‖ĉ − c‖/‖c‖, ‖k̂_R − k_R‖/‖k_R‖ (relative cache error of a path)",
    "sensitivity": "distortion / relative cache error of the quantized path",
    "rope_amplification": "sensitivity(RoPE-only) / sensitivity(content-only) at equal bits: >1 means a unit of "
                          "relative RoPE-key error distorts the attention output more than a unit of relative latent error",
    "logit_sensitivity": "RMS logit error (scale·Δ(q·k), causal entries) / relative cache error of the quantized path",
    "rope_logit_amplification": "logit_sensitivity(RoPE-only) / logit_sensitivity(content-only): the part of the "
                                "amplification already present in the logits (the rest comes from softmax and aggregation)",
    "rope_matching_amplification": "(matching error per unit relative error, RoPE-only) / (the same, content-only): "
                                   "how much more a unit of RoPE-key error perturbs the attention pattern's effect",
    "distortion_ratio": "distortion(RoPE-only) / distortion(content-only) at equal bits (group sizes as configured)",
    "pair rms": "per RoPE frequency pair j: sqrt(E[(x_a²+x_b²)/2]) of k_R and of q^R (pairs from spec.pair_index())",
    "pair_logit_err_rms": "per pair j: RMS over all (head, query, key) of scale·q_j^R·e_j (RoPE-only quantization)",
}


def collect_layer_tensors(model: torch.nn.Module, input_ids: torch.Tensor, layers: Iterable[int] | None = None,
                          batch_size: int = 1) -> dict[int, list[LayerTensors]]:
    """Run the full-precision model on `input_ids` [N, L] and return, per MLA cache slot, the
    layer's attention inputs (one LayerTensors per batch of `batch_size` sequences)."""
    spec = load_spec(model)
    mods = mla_modules(model)
    want = list(mods) if layers is None else [l for l in layers]
    bad = [l for l in want if l not in mods]
    if bad:
        raise QuantMLAError(f"layers {bad} are not MLA layers of this model; its MLA cache slots are {list(mods)}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise QuantMLAError(f"input_ids must be [N, L] with L >= 2, got {tuple(input_ids.shape)}")
    out: dict[int, list[LayerTensors]] = {l: [] for l in want}
    for i in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[i : i + batch_size]
        with torch.no_grad(), capture_attention_inputs(model, layers=want) as rec:
            model(ids, use_cache=False)
        for l in want:
            r = rec[l][0]
            view = MLAView(mods[l], spec)
            with torch.no_grad():
                p = view.parts(r["hidden"], r["position_embeddings"])
                pos = torch.arange(ids.shape[1], device=r["hidden"].device)  # mistral4 scales its queries by position
                q_nope, q_rope = (q.transpose(1, 2) for q in view.scale_queries(
                    pos, p["q_nope"].transpose(1, 2), p["q_rope"].transpose(1, 2)))
                out[l].append(LayerTensors(
                    q_lat=view.absorb(q_nope).double(), q_rope=q_rope.double(),
                    latent=p["latent"].double(), k_rope=p["k_rope"].double(),
                    w_uv=view.w_uv.detach().double(), scale=spec.softmax_scale,
                    w_o=mods[l].o_proj.weight.detach().double(),
                ))
    return out


def analyze_layer(batches: list[LayerTensors], pair_index, bits: Iterable[int], content_group: int, rope_group: int,
                  paths: Iterable[str] = PATHS, pair_bits: int = 4) -> dict:
    """All measurements of one layer (see DEFINITIONS)."""
    runs: dict[str, dict[str, dict]] = {}
    for path in paths:
        runs[path] = {}
        for b in bits:
            cf, rf = path_formats(path, b, content_group, rope_group)
            st = LayerStats()
            for t in batches:
                c_hat, kr_hat = quantize_paths(t, cf, rf)
                measure(t, c_hat, kr_hat, st)
            m = st.metrics()
            err = {"content": m["content_rel_err"], "rope": m["rope_rel_err"]}.get(path)
            if path == "both":
                # relative error of the whole cache vector [c, k_R]
                s = st.sums
                err = ((s["e_c"] + s["e_r"]) / (s["c"] + s["r"])) ** 0.5
            m["cache_rel_err"] = err
            m["sensitivity"] = m["distortion"] / err if err else float("nan")
            m["logit_sensitivity"] = m["logit_err_rms"] / err if err else float("nan")
            runs[path][str(b)] = m
    amp, ratio, logit_amp, match_amp = {}, {}, {}, {}
    if "content" in runs and "rope" in runs:
        for b in runs["content"]:
            c, r = runs["content"][b], runs["rope"][b]
            amp[b] = r["sensitivity"] / c["sensitivity"] if c["sensitivity"] else float("nan")
            logit_amp[b] = r["logit_sensitivity"] / c["logit_sensitivity"] if c["logit_sensitivity"] else float("nan")
            cm = c["matching"] / c["cache_rel_err"] if c["cache_rel_err"] else 0.0
            match_amp[b] = (r["matching"] / r["cache_rel_err"]) / cm if cm else float("nan")
            ratio[b] = r["distortion"] / c["distortion"] if c["distortion"] else float("nan")
    # per-pair energies over all batches (combine mean squares)
    n = sum(t.k_rope.shape[0] * t.k_rope.shape[1] for t in batches)
    k2 = q2 = le = None
    for t in batches:
        w = t.k_rope.shape[0] * t.k_rope.shape[1] / n
        e = pair_energies(t, pair_index)
        kr_hat = quantize_dequantize(t.k_rope, path_formats("rope", pair_bits, content_group, rope_group)[1])
        ple = pair_logit_error(t, kr_hat, pair_index)
        kk = torch.tensor(e["k_rope_rms"]) ** 2 * w
        qq = torch.tensor(e["q_rope_rms"]) ** 2 * w
        ll = torch.tensor(ple) * w
        k2 = kk if k2 is None else k2 + kk
        q2 = qq if q2 is None else q2 + qq
        le = ll if le is None else le + ll
    # logit energy of each path (how much of the logits each path carries)
    s_c = s_r = 0.0
    for t in batches:
        S = t.q_lat.shape[2]
        mask = torch.ones(S, S, dtype=torch.bool, device=t.q_lat.device).tril()
        lc = torch.einsum("bhsc,btc->bhst", t.q_lat, t.latent) * t.scale
        lr = torch.einsum("bhsr,btr->bhst", t.q_rope, t.k_rope) * t.scale
        s_c += float((lc.masked_fill(~mask, 0) ** 2).sum())
        s_r += float((lr.masked_fill(~mask, 0) ** 2).sum())
    return {
        "runs": runs,
        "rope_amplification": amp,
        "rope_logit_amplification": logit_amp,
        "rope_matching_amplification": match_amp,
        "distortion_ratio": ratio,
        "pairs": {
            "k_rope_rms": k2.sqrt().tolist(),
            "q_rope_rms": q2.sqrt().tolist(),
            f"logit_err_rms_int{pair_bits}": le.sqrt().tolist(),
        },
        "logit_rms_content": s_c,  # replaced by RMS below
        "logit_rms_rope": s_r,
    }


def analyze_model(model: torch.nn.Module, input_ids: torch.Tensor, *, bits=(2, 3, 4, 8), content_group: int = 64,
                  rope_group: int = 32, layers: Iterable[int] | None = None, pair_bits: int = 4, batch_size: int = 1,
                  progress=None) -> dict:
    """The full analysis of `model` on held-out token ids [N, L]; a JSON-ready dict."""
    spec = load_spec(model)
    spec.require_latent_cache()
    if spec.rope_cache_layout == "none":
        raise QuantMLAError(f"{spec.family}: its MLA layers apply no RoPE (NoPE); there is no RoPE path to analyze")
    for g, d, name in ((content_group, spec.d_c, "content"), (rope_group, spec.d_r, "RoPE")):
        if d % g:
            raise QuantMLAError(f"{name} group size {g} does not divide the {name} dim {d}; pick a divisor of {d}")
    bits = tuple(int(b) for b in bits)
    if not bits or any(b not in INT_BITS for b in bits):
        raise QuantMLAError(f"bits {bits}: the analysis measures integer codes' errors; give widths from {INT_BITS}")
    tensors = collect_layer_tensors(model, input_ids, layers, batch_size)
    pair_index = spec.pair_index()
    per_layer = []
    for l, batches in tensors.items():
        if progress:
            progress(f"layer {l}")
        r = analyze_layer(batches, pair_index, bits, content_group, rope_group, pair_bits=pair_bits)
        n_logits = sum(t.q_lat.shape[0] * t.q_lat.shape[1] * t.q_lat.shape[2] * (t.q_lat.shape[2] + 1) / 2 for t in batches)
        r["logit_rms_content"] = (r["logit_rms_content"] / n_logits) ** 0.5
        r["logit_rms_rope"] = (r["logit_rms_rope"] / n_logits) ** 0.5
        per_layer.append({"layer": l, **r})
    return {
        "spec": spec.to_dict(),
        "settings": {
            "bits": list(bits), "content_group": content_group, "rope_group": rope_group, "mode": "affine",
            "sequences": int(input_ids.shape[0]), "seq_len": int(input_ids.shape[1]), "pair_bits": pair_bits,
            "output_space": "after o_proj",
            "activations": "full-precision model, captured per layer; each layer's cache quantized alone (no error propagation)",
            "compute": "float64",
        },
        "definitions": DEFINITIONS,
        "layers": per_layer,
        "summary": summarize(per_layer, bits),
    }


def _gmean(xs: list[float]) -> float:
    xs = [x for x in xs if x and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(per_layer: list[dict], bits) -> dict:
    """Cross-layer summary: geometric means of ratios, means of distortions, worst first-order error."""
    out: dict = {"by_bits": {}}
    for b in map(str, bits):
        row = {}
        for path in PATHS:
            ds = [L["runs"][path][b]["distortion"] for L in per_layer if path in L["runs"]]
            row[f"{path}_distortion_mean"] = sum(ds) / len(ds) if ds else float("nan")
        c_runs = [L["runs"]["content"][b] for L in per_layer]
        row["content_matching_share_mean"] = sum(r["matching_share"] for r in c_runs) / len(c_runs)
        row["rope_amplification_gmean"] = _gmean([L["rope_amplification"][b] for L in per_layer])
        row["rope_matching_amplification_gmean"] = _gmean([L["rope_matching_amplification"][b] for L in per_layer])
        row["rope_logit_amplification_gmean"] = _gmean([L["rope_logit_amplification"][b] for L in per_layer])
        row["distortion_ratio_gmean"] = _gmean([L["distortion_ratio"][b] for L in per_layer])
        row["layers_rope_worse"] = sum(1 for L in per_layer if L["distortion_ratio"][b] > 1)
        row["first_order_rel_err_max"] = max(L["runs"][p][b]["first_order_rel_err"] for L in per_layer for p in PATHS)
        out["by_bits"][b] = row
    out["layers"] = len(per_layer)
    hi = str(max(int(b) for b in bits))
    out["first_order_check"] = {
        "bits": int(hi),
        "max_rel_err": out["by_bits"][hi]["first_order_rel_err_max"],
        "note": "‖Δo¹ − Δo‖/‖Δo‖ at the highest bit width, worst layer and path: the first-order model's error",
    }
    return out
