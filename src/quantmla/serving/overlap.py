"""Overlapped decode steps: the engine launches a decode step's CUDA graph before the previous step's tokens
reach the host, so that the GPU does not wait for the host's scheduling, copies and bookkeeping between steps.

A pure decode step is launched ahead when every token it feeds the model is either on the host or one the
step in flight samples (:func:`source_rows`): the graph then takes that token from the in-flight step's
output row (``DecodeGraphs.prev``). The scheduler commits a step launched ahead with ``PENDING`` tokens
(``Scheduler.commit_ahead``: lengths advance, sequences reaching ``max_new_tokens`` finish) and fills them
in when they arrive (``Scheduler.resolve``: end-of-sequence tokens and non-finite logits finish sequences
then). A sequence that finishes on its pending token has already been scheduled one more step; that row's
token is dropped, and its pages go back to the pool at once: every later user of them is queued after the
step in flight. Any step that is not launched ahead (prefill chunks, eager steps) first waits for the
tokens in flight, so the host only ever feeds real tokens to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.serving.graphs import DecodeLaunch
from quantmla.serving.scheduler import PENDING, Sequence, StepPlan


@dataclass
class PendingStep:
    """A decode step launched ahead: ``index`` (``Scheduler.commit_ahead``'s) places each item's pending token
    in its sequence's tokens; ``launch`` reads them back; ``t0``: host time (perf_counter) the step began;
    ``launch_s``: host seconds until its graph was launched."""

    plan: StepPlan
    index: list[int]
    launch: DecodeLaunch
    t0: float
    launch_s: float


def source_rows(plan: StepPlan, pending: PendingStep | None) -> list[int] | None:
    """Per item of a pure decode ``plan``, the row of ``pending`` whose output is its input token (-1: the
    host has the token). None when an input token is pending anywhere else (then the plan must wait)."""
    rows = {}
    if pending is not None:  # a step launched ahead is pure decode: its items are its graph's rows, in order
        for k, it in enumerate(pending.plan.items):
            if pending.index[k] >= 0:
                rows[id(it.seq)] = (k, pending.index[k])
    src = []
    for it in plan.items:
        if it.seq.tokens[it.start] != PENDING:
            src.append(-1)
            continue
        row, at = rows.get(id(it.seq), (-1, -1))
        if at != it.start:
            return None
        src.append(row)
    return src


def nonfinite_error(seq: Sequence, n: int) -> str:
    """The failure of a request whose output token ``n`` (0-based) came from logits holding NaN or Inf."""
    return (f"request {seq.req.request_id!r}: the model's logits for its output token {n} hold NaN or Inf "
            f"(activations overflowed, or the weights hold NaN/Inf); serve in bfloat16 or float32, or check the "
            f"checkpoint")
