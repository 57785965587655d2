"""Greedy agreement of the engine with transformers ``generate()`` on ``QuantMLACache``.

For each prompt the reference is ``model.generate(..., past_key_values=QuantMLACache(model, quant),
do_sample=False)`` with its per-step scores. The engine's tokens must equal it token for token,
except that a divergence is accepted as a *tie* when, at the first differing step, the reference's
own logits put the engine's token within ``tie_tol`` of its argmax (both continuations are then
greedy-valid up to rounding; the sequences differ from there on, so comparison stops).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.cache.hf_cache import QuantMLACache


@dataclass
class AgreementReport:
    requests: int = 0
    exact: int = 0
    ties: int = 0
    mismatches: int = 0
    tokens_compared: int = 0
    tie_margins: list = field(default_factory=list)
    details: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()} | {"ok": self.ok}


def reference_generate(model, quant: QuantCacheConfig, prompt: list[int], max_new_tokens: int, cache_factory=None):
    """-> (tokens, per-step fp32 logits [max_new, V]) of HF greedy decoding with QuantMLACache (or the cache
    ``cache_factory()`` makes, e.g. the RoPE-per-page RopeChannelCache for an engine with rope_pages)."""
    dev = next(model.parameters()).device
    cache = cache_factory() if cache_factory is not None else QuantMLACache(model, quant)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=dev), past_key_values=cache, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    toks = out.sequences[0, len(prompt):].tolist()
    scores = torch.stack([s[0].float() for s in out.scores]).cpu()
    return toks, scores


def compare(model, quant: QuantCacheConfig, prompts: list[list[int]], engine_tokens: list[list[int]], max_new_tokens: int,
            tie_tol: float = 1e-3, cache_factory=None) -> AgreementReport:
    rep = AgreementReport(requests=len(prompts))
    for i, (p, got) in enumerate(zip(prompts, engine_tokens)):
        ref, scores = reference_generate(model, quant, p, max_new_tokens, cache_factory)
        j = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if j is None and len(got) == len(ref):
            rep.exact += 1
            rep.tokens_compared += len(ref)
            continue
        if j is None:  # different lengths
            rep.mismatches += 1
            rep.details.append({"request": i, "engine_len": len(got), "reference_len": len(ref)})
            continue
        rep.tokens_compared += j + 1
        margin = float(scores[j, ref[j]] - scores[j, got[j]])
        scale = float(scores[j].abs().max())
        entry = {"request": i, "step": j, "engine": got[j], "reference": ref[j], "margin": margin, "logit_absmax": scale}
        if margin <= tie_tol * max(1.0, scale):
            rep.ties += 1
            rep.tie_margins.append(margin)
            entry["tie"] = True
        else:
            rep.mismatches += 1
            entry["tie"] = False
        rep.details.append(entry)
    return rep


def engine_agreement(model, quant: QuantCacheConfig, prompts: list[list[int]], max_new_tokens: int, tie_tol: float = 1e-3,
                     cache_factory=None, **engine_kw) -> tuple[AgreementReport, dict]:
    """Run the engine on `prompts` (EOS ignored) and compare with the reference (its cache from
    ``cache_factory``, default QuantMLACache). -> (report, engine stats)."""
    from quantmla.serving.engine import Engine, EngineConfig
    from quantmla.serving.scheduler import SamplingParams

    kw = {"page_size": 16, "max_num_batched_tokens": 64, "num_pages": 256, **engine_kw}
    with Engine(model, EngineConfig(quant=quant, **kw)) as eng:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        stats = eng.stats.to_dict() | {"backend": eng.backend.name, "cuda_graphs": eng.use_graphs,
                                       "graph_error": eng.graph_error, "prefill_graphs": eng.use_prefill_graphs,
                                       "prefill_graph_error": eng.prefill_graph_error}
    rep = compare(model, quant, prompts, [o.output_ids for o in outs], max_new_tokens, tie_tol, cache_factory)
    return rep, stats


def local_reference_models(root: str | None = None) -> list[str]:
    """Checkpoint directories under models/ (from_pretrained dirs with a config.json)."""
    import os

    from quantmla.corpus.datasets import models_root

    root = root or str(models_root())
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "config.json")))
