"""Each engine step of a serve-bench run as the host sees it, through the engine's public observer hook.

A step's ``launch_ms`` is the host time until all its GPU work was queued and ``total_ms`` until its tokens were
back (``serving.graphs.StepTiming``). Where ``launch_ms`` is close to ``total_ms`` the step waits on the host
(Python launches, metadata, copies); where it is much shorter the GPU sets the step's time.

- Steps that prefill (prompt chunks, a preempted sequence's recomputed tokens included, with or without decode
  rows) are kept one record each, in order: their kind ("prefill_graph", "mixed_graph", "eager", or "graph_decode"
  where every chunk is one token, which the engine then runs and times as a decode step), prompt tokens, chunks,
  decode rows, tokens sampled (the decode rows and the chunks that end a prompt), launch_ms and total_ms.
- The counts are exact where no sequence ends while a step launched ahead of it is in flight (an end-of-sequence
  token or NaN logits): serve-bench ignores EOS, so only NaN logits can make the log count a dropped row.
- Pure decode steps are summed by batch: steps, the sum and median of total_ms, the median of launch_ms.
- Given a :class:`CompileWatch`, each prefilling step and each batch's decode steps also say how many kernels
  compiled inside them (``compiles``, and ``compile_ms`` for a prefilling step), and the summary says what
  compiled in the whole run (``compiles``: count, seconds, Triton kernels by name, nvcc builds).
"""

from __future__ import annotations

import statistics

from quantmla.serving.graphs import EngineObserver
from quantmla_lab.bench.serving.compile_watch import CompileWatch


class StepLog(EngineObserver):
    """Collects one run's steps; ``summary()`` gives the JSON the run's result keeps."""

    def __init__(self, watch: CompileWatch | None = None):
        self.prefill: list[dict] = []
        self.decode: dict[int, list[tuple[float, float, int]]] = {}
        self.watch = watch
        self._compiled = watch.snapshot() if watch is not None else (0, 0.0)

    def _compiles(self) -> tuple[int, float]:
        """Compiles (count, ms) since the previous step ended."""
        if self.watch is None:
            return 0, 0.0
        (n0, s0), (n, s) = self._compiled, self.watch.snapshot()
        self._compiled = (n, s)
        return n - n0, 1e3 * (s - s0)

    def step_end(self, timing) -> None:
        plan = timing.plan
        launch = timing.launch_s
        compiles, compile_ms = self._compiles()
        if plan.is_decode:
            self.decode.setdefault(len(plan.items), []).append((1e3 * timing.total_s, 1e3 * launch, compiles))
            return
        chunks = [it.n for it in plan.items if it.n > 1 or not it.sample or it.start < it.seq.prompt_len]
        self.prefill.append({"kind": timing.kind, "prompt_tokens": sum(chunks), "chunks": len(chunks),
                             "decode_rows": len(plan.items) - len(chunks),
                             "sampled": sum(1 for it in plan.items if it.sample), "launch_ms": round(1e3 * launch, 3),
                             "total_ms": round(1e3 * timing.total_s, 3), "compiles": compiles,
                             "compile_ms": round(compile_ms, 3)})

    def summary(self) -> dict:
        pre = self.prefill
        out = {
            "prefill_steps": pre,
            "prefill_total_s": round(sum(r["total_ms"] for r in pre) / 1e3, 3),
            "prefill_launch_s": round(sum(r["launch_ms"] for r in pre) / 1e3, 3),
            "decode_by_batch": {
                str(b): {"steps": len(v), "total_s": round(sum(t for t, _, _ in v) / 1e3, 4),
                         "total_ms_median": round(statistics.median(t for t, _, _ in v), 3),
                         "launch_ms_median": round(statistics.median(la for _, la, _ in v), 3),
                         "compiles": sum(c for _, _, c in v)}
                for b, v in sorted(self.decode.items())
            },
        }
        if self.watch is not None:
            out["compiles"] = self.watch.summary()
        return out
