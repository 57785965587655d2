"""Long-range retrieval accuracy, with every attention read going through a cache.

``retrieval_accuracy(model, tokenizer, samples, cache_factory=...)``

A sample is a dict with ``prompt`` and ``answer`` strings (see
:mod:`quantmla_lab.training.tasks` for the format), or with ``prompt_ids`` / ``answer_ids``.
Both strings are tokenized without special tokens and concatenated. One teacher-forced
forward over ``prompt + answer`` (``[1, n_tokens]``, ``past_key_values=cache_factory(model)``,
a fresh cache per sample, ``use_cache=True``); the sample is correct when, at every answer
position, the answer token is the argmax of the logits — exactly what greedy decoding of
the answer would produce. (The prefill attends through the cache: keys/values are read
back from ``cache.update``; with a full-precision window or RoPE keys blocked per channel each
query reads the cache as its decode step would, over expanded keys: ``evaluation.decode_reads``.)

Returns a dict: ``accuracy`` (fraction correct), ``correct``, ``n``, ``per_sample``
(list of bools), ``answer_logprob`` (mean log-probability of the answer tokens, nats),
``min_margin`` per sample (smallest logit gap between the answer token and the best other
token over the answer positions; negative when wrong), ``mean_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from quantmla.evaluation.decode_reads import DECODE_BATCH, decode_logits, reads_by_steps


def _answer_logits(model, pairs: list[tuple[list[int], list[int]]], cache_factory, device):
    """Per (prompt ids, answer ids) pair, the logits [len(answer), V] (float32) that predict the answer's tokens: the
    logits at position t predict token t + 1, so the answer's sit at len(prompt) - 1 .. len(prompt) + len(answer) - 2.
    A pair a forward; where the cache is read a forward a token (decode_reads.reads_by_steps: an attention without
    an additive mask), DECODE_BATCH pairs together, right-padded (decode steps cost the same for one sequence or
    several)."""
    ready = cache_factory(model) if cache_factory is not None and pairs else None  # the first group's
    batch = DECODE_BATCH if ready is not None and reads_by_steps(ready, model) else 1
    for i in range(0, len(pairs), batch):
        group = pairs[i : i + batch]
        T = max(len(p) + len(a) for p, a in group)
        ids = torch.zeros(len(group), T, dtype=torch.long, device=device)
        for j, (p, a) in enumerate(group):
            ids[j, : len(p) + len(a)] = torch.tensor(p + a, dtype=torch.long)
        first = min(len(p) for p, _ in group) - 1
        cache = ready if ready is not None else cache_factory(model) if cache_factory is not None else None
        ready = None
        logits = decode_logits(model, ids, cache, first=first)
        for j, (p, a) in enumerate(group):
            yield logits[j, len(p) - 1 - first : len(p) - 1 - first + len(a)]


def _ids(tokenizer, sample: dict) -> tuple[list[int], list[int]]:
    if "prompt_ids" in sample:
        return list(sample["prompt_ids"]), list(sample["answer_ids"])
    p = tokenizer(sample["prompt"], add_special_tokens=False, verbose=False)["input_ids"]
    a = tokenizer(sample["answer"], add_special_tokens=False, verbose=False)["input_ids"]
    return p, a


@torch.no_grad()
def retrieval_accuracy(
    model,
    tokenizer,
    samples: Sequence[dict],
    *,
    cache_factory: Callable | None = None,
    device: str | torch.device | None = None,
) -> dict:
    """Fraction of samples whose every answer token is the model's argmax (greedy-exact)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    per_sample, margins, logprobs, lengths = [], [], [], []
    pairs = [_ids(tokenizer, s) for s in samples]
    for (p, a), logits in zip(pairs, _answer_logits(model, pairs, cache_factory, device)):
        target = torch.tensor(a, device=device)
        tgt_logit = logits.gather(-1, target[:, None]).squeeze(-1)
        other = logits.scatter(-1, target[:, None], float("-inf")).max(-1).values
        margin = float((tgt_logit - other).min())
        per_sample.append(margin > 0)
        margins.append(margin)
        logprobs.append(float(torch.log_softmax(logits, -1).gather(-1, target[:, None]).mean()))
        lengths.append(len(p) + len(a))
    if was_training:
        model.train()
    n = len(per_sample)
    return {
        "accuracy": sum(per_sample) / max(n, 1),
        "correct": sum(per_sample),
        "n": n,
        "per_sample": per_sample,
        "min_margin": margins,
        "answer_logprob": sum(logprobs) / max(n, 1),
        "mean_tokens": sum(lengths) / max(n, 1),
    }
