"""What a job's requests must be before any token of them reaches the model.

``Engine.generate`` takes Request objects or token-id lists (:func:`as_requests`), gives each its stop tokens
(:func:`eos_ids`) and fails alone, with the reason, every request that cannot run at all (:func:`refusal`): an
empty or ill-typed prompt, token ids outside the vocabulary, a ``max_new_tokens`` that is not a whole number of at
least 1, more positions than the model was built for, or more cached tokens than the engine's block tables hold.
A request that could run but never fits the KV budget is the scheduler's to fail (``Scheduler.add``).
"""

from __future__ import annotations

from numbers import Integral

import torch

from quantmla.errors import QuantMLAError
from quantmla.serving.scheduler import Request, SamplingParams


def is_token_id(t) -> bool:
    """An int (numpy's too) or a one-element integer tensor; not a bool, a float or a string."""
    if isinstance(t, torch.Tensor):
        return t.numel() == 1 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    return isinstance(t, Integral) and not isinstance(t, bool)


def as_requests(requests, params: SamplingParams | None = None) -> list[Request]:
    """Request objects as they are, token-id lists as ``Request(index, ids, params)`` (a generator is read once);
    `params` beside Request objects is refused (each carries its own)."""
    requests = list(requests)
    if params is not None and any(isinstance(r, Request) for r in requests):
        raise QuantMLAError("generate(requests, params): params are for token-id lists; a Request carries its "
                            "own SamplingParams (Request(id, prompt, params))")
    return [r if isinstance(r, Request) else Request(i, list(r), params or SamplingParams())
            for i, r in enumerate(requests)]


def eos_ids(req: Request, default: set[int]) -> set[int]:
    """The token ids that end `req`: its ``eos_token_id`` (an int, a list or a tensor of them), else `default`."""
    e = req.params.eos_token_id
    e = e.reshape(-1).tolist() if isinstance(e, torch.Tensor) else e  # (a tensor hashes by identity)
    return default if e is None else {int(x) for x in e} if isinstance(e, (list, tuple, set)) else {int(e)}


def refusal(req: Request, vocab: int | None, max_positions: int | None, width: int, capacity: int) -> str | None:
    """Why `req` cannot run at all, naming it and the fix, or None. `vocab`: the model's vocabulary size;
    `max_positions`: its max_position_embeddings (None: unbounded); `width`: the tokens a block table holds;
    `capacity`: the tokens the KV budget holds (a request past it is the scheduler's to fail)."""
    rid = f"request {req.request_id!r}"
    if len(req.prompt) == 0:
        return f"{rid}: the prompt is empty; give at least one token"
    if not all(is_token_id(t) for t in req.prompt):
        return f"{rid}: the prompt must be token ids (ints); tokenize text first"
    n = req.params.max_new_tokens
    if not isinstance(n, Integral) or isinstance(n, bool) or n < 1:
        return f"{rid}: max_new_tokens must be a whole number, at least 1, got {n!r}"
    lo, hi = min(req.prompt), max(req.prompt)
    if lo < 0 or (vocab is not None and hi >= vocab):
        return f"{rid}: token ids must lie in [0, {vocab}); this prompt has {lo if lo < 0 else hi}"
    need = req.positions
    if max_positions and need > max_positions:
        return (f"{rid} needs {need} positions but the model has max_position_embeddings {max_positions}: shorten the "
                "prompt or max_new_tokens")
    if width < need <= capacity:  # fits the budget but not the block-table width
        return (f"{rid} needs {need} cached tokens but the engine was built for sequences of at most {width} "
                "(EngineConfig.max_model_len); build it with a larger max_model_len")
    return None
