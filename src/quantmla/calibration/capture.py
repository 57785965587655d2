"""Capture what calibration needs from full-precision forwards, per MLA layer, in bounded memory.

Per layer and calibration sequence (length L) we keep:

- the cached latent ``c`` [L, d_c] and rotated RoPE key ``k_R`` [L, d_r] of every token (keys
  and values of the attention that the content objective re-runs);
- ``S_q`` sampled query positions (``queries_per_seq``): their absorbed content queries
  ``q̃ = q^C·W_UK`` [S_q, H, d_c] and rotated RoPE queries ``q^R`` [S_q, H, d_r];
- for the RoPE objective, a subsample of keys (position 0, the usual attention sink, always
  kept; the others drawn uniformly and reweighted so sums stay unbiased) with one d_r × d_r
  matrix each, ``A(u)`` with  ``Σ_{i,t} w_{i,t}(u)·(scale·q_i^R(t)·e)² = eᵀ·A(u)·e`` for any key
  error e: the positional QK error as a quadratic form. Two weightings:

    uniform:    w = 1 for every head i and query t ≥ u (docs/design.md §4, all query positions);
    attention:  w = p_{i,t}(u), the full-precision attention probability (sampled queries) — the
                weighting in the output-distortion bound (see :mod:`quantmla.calibration.bound`).

Memory is bounded: bytes per layer are estimated up front and the layers are captured in as many
forward passes over the calibration data as ``max_bytes`` requires (a progress bar per pass).

Per-layer entry points (used here and by layer-streamed calibration, calibration/stream/fitters.py):
:func:`plan_capture` samples the query and key positions once per calibration set, and a
:class:`LayerCapture` records one layer's inputs batch by batch into its :class:`LayerData`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.errors import NonFiniteError, QuantMLAError
from quantmla.model.spec import MLASpec, mla_modules
from quantmla.model.view import MLAView

WEIGHTINGS = ("attention", "uniform")


@dataclass
class LayerData:
    slot: int
    scale: float  # softmax scale
    gamma: torch.Tensor  # kv_a_layernorm weight at capture time [d_c]
    out_proj: torch.Tensor  # [H, d_c, hidden]: latent-space head output -> attention-block output (W_UV then o_proj)
    rope_layout: str  # pair layout of the cached RoPE key
    latent: list = field(default_factory=list)  # per batch [B, L, d_c]
    k_rope: list = field(default_factory=list)  # per batch [B, L, d_r]
    q_pos: list = field(default_factory=list)  # per batch [B, S_q]
    q_latent: list = field(default_factory=list)  # [B, S_q, H, d_c]
    q_rope: list = field(default_factory=list)  # [B, S_q, H, d_r]
    key_seq: list = field(default_factory=list)  # [K_b] sequence index of each kept RoPE key
    keys: list = field(default_factory=list)  # [K_b, d_r]
    A: dict = field(default_factory=lambda: {w: [] for w in WEIGHTINGS})  # weighting -> [K_b, d_r, d_r]
    q_pair_sq: torch.Tensor | None = None  # Σ over all queries/heads of q_R² per channel [d_r]
    n_queries: int = 0
    # the family's RoPE phase at positions 0 … L−1 per cache pair, complex [L, d_r/2] (|·| = 1), and the
    # model's context (max_position_embeddings): what centring the RoPE keys over a context needs
    rope_phase: torch.Tensor | None = None
    max_positions: int | None = None
    key_ref: torch.Tensor | None = None  # the kept keys before centring: the RoPE objective's energy reference
    key_pos: torch.Tensor | None = None  # [K] positions of the kept keys, the same in every sequence (keys = k_rope[:, key_pos])

    def finalize(self) -> None:
        for name in ("latent", "k_rope", "q_pos", "q_latent", "q_rope", "key_seq", "keys"):
            v = getattr(self, name)
            if isinstance(v, list):
                setattr(self, name, torch.cat(v, 0))
        self.A = {k: torch.cat(v, 0) if isinstance(v, list) else v for k, v in self.A.items()}

    @property
    def num_seqs(self) -> int:
        return self.latent.shape[0]


def layer_capture_bytes(spec: MLASpec, n: int, L: int, s_q: int, k_per_seq: int) -> int:
    """Bytes of one layer's captured data for n sequences of L tokens, s_q sampled queries and
    k_per_seq kept RoPE keys per sequence (the per-head ``out_proj`` not counted)."""
    per_seq = L * (spec.d_c + spec.d_r) + s_q * spec.num_heads * (spec.d_c + spec.d_r)
    per_seq += k_per_seq * (spec.d_r + 1 + 2 * spec.d_r * spec.d_r)
    return 4 * n * per_seq


def _sample_positions(L: int, k: int, g: torch.Generator) -> torch.Tensor:
    k = min(k, L)
    return torch.randperm(L, generator=g)[:k].sort().values


def _sample_keys(L: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Position 0 with weight 1, k − 1 others uniformly with weight (L − 1)/(k − 1)."""
    if k >= L:
        return torch.arange(L), torch.ones(L)
    rest = (torch.randperm(L - 1, generator=g)[: k - 1] + 1).sort().values
    pos = torch.cat([torch.zeros(1, dtype=torch.long), rest])
    w = torch.full((k,), (L - 1) / max(1, k - 1))
    w[0] = 1.0
    return pos, w


@dataclass(frozen=True)
class CapturePlan:
    """What is sampled once per calibration set and shared by every layer: the query positions
    of each sequence, the kept RoPE key positions (the same in every sequence) and their weights,
    and the bytes one layer's captured data takes."""

    q_pos: torch.Tensor  # [N, S_q]
    key_pos: torch.Tensor  # [K]
    key_w: torch.Tensor  # [K]
    layer_bytes: int

    def check_budget(self, max_bytes: int, what: str = "max_bytes") -> None:
        if self.layer_bytes > max_bytes:
            raise QuantMLAError(
                f"one layer's calibration data needs {self.layer_bytes / 2**20:.0f} MiB, over the "
                f"{max_bytes / 2**20:.0f} MiB budget ({what}): use fewer or shorter calibration sequences, "
                "fewer queries_per_seq or rope_keys_per_seq, or raise the budget"
            )


def plan_capture(spec: MLASpec, shape: tuple[int, int], *, queries_per_seq: int = 64, rope_keys_per_seq: int = 128,
                 seed: int = 0) -> CapturePlan:
    """The sampled positions for calibration ids of shape [N, L] (generator seeded `seed`): the
    plan :func:`capture_calibration_data` uses, and the one a layer-streamed capture must use to
    get the same data."""
    N, L = (int(x) for x in shape)
    if L < 2:
        raise QuantMLAError(f"calibration sequences need at least 2 tokens, got length {L}")
    g = torch.Generator().manual_seed(seed)
    s_q = min(queries_per_seq, L)
    k_r = min(rope_keys_per_seq, L)
    q_pos = torch.stack([_sample_positions(L, s_q, g) for _ in range(N)])  # [N, S_q]
    key_pos, key_w = _sample_keys(L, k_r, g)  # the same key positions in every sequence
    return CapturePlan(q_pos, key_pos, key_w, layer_capture_bytes(spec, N, L, s_q, k_r))


def _check_finite(slot: int, module: torch.nn.Module, hidden: torch.Tensor, recorded: dict) -> None:
    """NonFiniteError naming the layer and the cause when what a layer is about to record holds NaN
    or Inf (raised as the layer is reached, before later layers run on the bad values)."""
    bad = {k: t for k, t in recorded.items() if not torch.isfinite(t).all()}
    if not bad:
        return
    n_nan = sum(int(torch.isnan(t).sum()) for t in bad.values())
    n_inf = sum(int(torch.isinf(t).sum()) for t in bad.values())
    params = [n for n, p in module.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if not torch.isfinite(hidden).all():
        cause = "its input hidden states are already non-finite (NaN/Inf weights in the embeddings or an earlier layer)"
    elif params:
        cause = f"its attention weights are not finite ({', '.join(params[:3])})"
    else:
        cause = "its weights are finite, so the attention projections overflowed"
    raise NonFiniteError(
        f"MLA layer {slot}: the activations to calibrate contain {n_nan} NaN and {n_inf} Inf values "
        f"({', '.join(bad)}): {cause}. Calibration needs finite activations: repair or re-download the checkpoint "
        "so that every weight is finite (and check the calibration text)")


@torch.no_grad()
def _record(data: LayerData, view: MLAView, hidden, pe, q_pos: torch.Tensor, key_pos: torch.Tensor,
            key_w: torch.Tensor, seq_offset: int, store_device: torch.device | str | None = None) -> None:
    p = view.parts(hidden, pe)
    B, L = hidden.shape[:2]
    scale = data.scale
    latent = p["latent"].float()  # [B, L, d_c]
    k_rope = p["k_rope"].float()  # [B, L, d_r]
    # the queries as attention sees them (mistral4 scales them by position; a row starts at position 0)
    q_nope_all, q_rope_all = view.scale_queries(torch.arange(L, device=hidden.device), p["q_nope"].transpose(1, 2),
                                                p["q_rope"].transpose(1, 2))  # [B, L, H, d]
    q_rope_all = q_rope_all.float().transpose(1, 2)  # [B, H, L, d_r]
    bidx = torch.arange(B, device=hidden.device)[:, None]
    q_nope = q_nope_all[bidx, q_pos].float()  # [B, S_q, H, d_n]
    q_lat = torch.einsum("bqhn,hnc->bqhc", q_nope, view.w_uk.float())
    q_r = q_rope_all.transpose(1, 2)[bidx, q_pos]  # [B, S_q, H, d_r]
    _check_finite(data.slot, view.m, hidden, {"latent": latent, "RoPE key": k_rope, "content query": q_lat,
                                              "RoPE query": q_r})
    dev = torch.device(store_device or "cpu")
    data.latent.append(latent.to(dev))
    data.k_rope.append(k_rope.to(dev))
    data.q_pos.append(q_pos.to(dev))
    data.q_latent.append(q_lat.to(dev))
    data.q_rope.append(q_r.to(dev))

    # per-channel query energy (all queries, all heads), for the closed-form baselines
    sq = q_rope_all.pow(2).sum(dim=(0, 1, 2)).to(dev)
    data.q_pair_sq = sq if data.q_pair_sq is None else data.q_pair_sq + sq
    data.n_queries += B * L * q_rope_all.shape[1]

    # uniform causal weighting: A(u) = scale² Σ_{t >= u} Σ_i q q^T  (reverse cumulative sum over t)
    outer = torch.einsum("bhtr,bhts->btrs", q_rope_all, q_rope_all)  # [B, L, d_r, d_r]
    a_unif = outer.flip(1).cumsum(1).flip(1)[:, key_pos] * scale**2  # [B, K, d_r, d_r]
    # attention weighting over the sampled queries: A(u) = scale² Σ_{i,t} p_{i,t}(u) q q^T
    s = torch.einsum("bqhc,blc->bhql", q_lat, latent) + torch.einsum("bqhr,blr->bhql", q_r, k_rope)
    s = s * scale
    causal = torch.arange(L, device=s.device)[None, None, :] > q_pos.to(s.device)[:, :, None]  # [B, S_q, L]
    s = s.masked_fill(causal[:, None], float("-inf"))
    prob = torch.softmax(s, -1)[..., key_pos]  # [B, H, S_q, K]
    a_attn = torch.einsum("bhqk,bqhr,bqhs->bkrs", prob, q_r, q_r) * scale**2
    # rescale the attention weighting from S_q sampled queries to all L query positions
    a_attn = a_attn * (L / q_pos.shape[1])
    w = key_w.to(s.device)[None, :, None, None]
    data.A["uniform"].append((a_unif * w).reshape(-1, view.spec.d_r, view.spec.d_r).to(dev))
    data.A["attention"].append((a_attn * w).reshape(-1, view.spec.d_r, view.spec.d_r).to(dev))
    data.keys.append(k_rope[:, key_pos].reshape(-1, view.spec.d_r).to(dev))
    data.key_pos = key_pos.to(dev)
    data.key_seq.append((torch.arange(B, device=dev)[:, None] + seq_offset).expand(B, len(key_pos)).reshape(-1))


def out_projection(view: MLAView) -> torch.Tensor:
    """[H, d_c, hidden]: per-head latent output -> contribution to the attention block's output."""
    s = view.spec
    w_o = view.m.o_proj.weight.detach().float().view(-1, s.num_heads, s.d_v)  # [hidden, H, d_v]
    return torch.einsum("hvc,dhv->hcd", view.w_uv.detach().float(), w_o).cpu()


@torch.no_grad()
def rope_phase(view: MLAView, position_embeddings, L: int, device) -> torch.Tensor:
    """The family's RoPE rotation of each cache pair at positions 0 … L−1 as unit complex numbers
    [L, d_r/2], read off by rotating a key that is 1 on every pair's first channel (weight layout)."""
    spec = view.spec
    if position_embeddings is None or spec.rope_weight_layout == "none":  # NoPE layers (kimi_linear): no rotation
        return torch.ones(L, spec.d_r // 2, dtype=torch.complex128)
    k = torch.zeros(1, L, spec.d_r, device=device)
    k[..., spec.pair_index(spec.rope_weight_layout)[0].to(device)] = 1.0
    q = torch.zeros(1, 1, L, spec.d_r, device=device)
    pe = position_embeddings
    if isinstance(pe, (tuple, list)):
        pe = tuple(p[:1, :L].to(device=device, dtype=torch.float32) for p in pe)
    else:
        pe = pe[:1, :L] if pe.dim() > 1 else pe
    _, kr = view.rotate(q, k, pe)
    ra, im = spec.pair_index(spec.rope_cache_layout)
    kr = kr.reshape(L, spec.d_r).double().cpu()
    z = torch.complex(kr[:, ra], kr[:, im])
    return z / z.abs().clamp_min(1e-30)


class LayerCapture:
    """The capture of one MLA layer, batch by batch: the per-layer entry point shared by
    :func:`capture_calibration_data` (forward hooks on the whole model) and layer-streamed
    calibration (forward hooks on one streamed layer).

    >>> cap = LayerCapture(slot, module, spec, plan)   # before the layer's forward
    >>> cap.record(hidden, position_embeddings, start)  # the MLA module's inputs, every batch
    >>> data = cap.finish()                             # -> LayerData (tensors on store_device)
    """

    def __init__(self, slot: int, module: torch.nn.Module, spec: MLASpec, plan: CapturePlan,
                 store_device: torch.device | str | None = None):
        self.view = MLAView(module, spec)
        self.plan = plan
        self.store_device = store_device
        dev = store_device or "cpu"
        self.data = LayerData(
            slot=slot, scale=spec.softmax_scale, gamma=module.kv_a_layernorm.weight.detach().float().to(dev).clone(),
            out_proj=out_projection(self.view).to(dev), rope_layout=spec.rope_cache_layout,
        )

    @torch.no_grad()
    def record(self, hidden: torch.Tensor, position_embeddings, start: int) -> None:
        """One batch of the module's inputs: hidden [B, L, hidden] of sequences start … start+B−1."""
        dev = hidden.device
        if self.data.rope_phase is None and self.view.spec.d_r:
            self.data.rope_phase = rope_phase(self.view, position_embeddings, hidden.shape[1], dev)
            self.data.max_positions = self.view.spec.max_positions
        q_pos = self.plan.q_pos[start : start + hidden.shape[0]].to(dev)
        _record(self.data, self.view, hidden, position_embeddings, q_pos, self.plan.key_pos.to(dev), self.plan.key_w,
                start, self.store_device)

    def finish(self) -> LayerData:
        self.data.finalize()
        return self.data


def capture_calibration_data(
    model: torch.nn.Module,
    spec: MLASpec,
    calib_ids: torch.Tensor,
    *,
    layers: list[int] | None = None,
    queries_per_seq: int = 64,
    rope_keys_per_seq: int = 128,
    batch_size: int = 4,
    max_bytes: int = 2 << 30,
    seed: int = 0,
    progress: bool = True,
    store_device: torch.device | str | None = None,
) -> dict[int, LayerData]:
    """Run the full-precision model over calib_ids [N, L] and return slot -> LayerData (its tensors
    on `store_device`, default CPU; fitting then runs there)."""
    from tqdm.auto import tqdm

    if calib_ids.dim() != 2 or calib_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise QuantMLAError(f"calibration ids must be an integer tensor [N, L], got {tuple(calib_ids.shape)} {calib_ids.dtype}")
    N, L = calib_ids.shape
    mods = mla_modules(model)
    layers = list(mods) if layers is None else list(layers)
    plan = plan_capture(spec, (N, L), queries_per_seq=queries_per_seq, rope_keys_per_seq=rope_keys_per_seq, seed=seed)
    plan.check_budget(max_bytes)
    chunk = max(1, int(max_bytes // max(1, plan.layer_bytes)))
    device = next(model.parameters()).device
    out: dict[int, LayerData] = {}
    passes = [layers[i : i + chunk] for i in range(0, len(layers), chunk)]
    for pi, group in enumerate(passes):
        caps = {slot: LayerCapture(slot, mods[slot], spec, plan, store_device) for slot in group}
        state = {"start": 0}

        def make_hook(slot):
            def hook(module, args, kwargs):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                caps[slot].record(hidden, kwargs.get("position_embeddings"), state["start"])

            return hook

        handles = [mods[slot].register_forward_pre_hook(make_hook(slot), with_kwargs=True) for slot in group]
        desc = "capturing activations" + (f" (pass {pi + 1}/{len(passes)})" if len(passes) > 1 else "")
        try:
            with torch.no_grad():
                for start in tqdm(range(0, N, batch_size), desc=desc, disable=not progress, leave=False):
                    state["start"] = start
                    model(input_ids=calib_ids[start : start + batch_size].to(device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        for slot in group:
            out[slot] = caps[slot].finish()
    return out
