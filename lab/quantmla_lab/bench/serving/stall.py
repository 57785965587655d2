"""A watch over serve-bench's engines: when an engine step or graph capture has not finished after `limit` seconds,
the GPU is most likely stuck in a kernel that never returns (a deadlock), and nothing would ever end the run. The
watch then says which method, which step and for how long, dumps every thread's Python stack, and ends the process
with exit status 3, so a benchmark under a time limit fails with a reason instead of running out of its time.

It observes the engines through their public hook (``Engine.observers``) and a daemon thread that wakes every
`poll` seconds; the main thread may be blocked inside a CUDA call, which releases the interpreter to this thread.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

from quantmla.serving.graphs import EngineObserver

EXIT_STALLED = 3


class StallWatch(EngineObserver):
    """Observer of one or more engines (``engine.observers.append(watch.observer(name))``); `limit` seconds an
    engine step or capture may take; `on_stall(message)` instead of dumping stacks and exiting (tests)."""

    def __init__(self, limit: float, poll: float = 1.0, on_stall=None, stream=None):
        if limit <= 0:
            raise ValueError(f"a stall limit must be positive seconds, not {limit}")
        self.limit, self.poll = float(limit), float(poll)
        self.on_stall = on_stall
        self.stream = stream or sys.stderr
        self._lock = threading.Lock()
        self._open: dict[tuple, list[tuple[float, str]]] = {}  # (kind, method) -> begun, not ended: (start, what)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-bench stall watch", daemon=True)
        self._thread.start()

    def observer(self, name: str) -> EngineObserver:
        """An observer for the engine of method `name`."""
        watch = self

        class _Named(EngineObserver):
            def step_begin(self, plan):
                kind = "decode" if plan.is_decode else "mixed"
                watch._begin(("step", name), f"{name}: a {kind} step of {len(plan.items)} sequences "
                                             f"({plan.num_tokens} tokens)")

            def step_end(self, timing):
                watch._end(("step", name))

            def capture_begin(self, graph, size):
                watch._begin(("capture", name), f"{name}: the capture of the {graph} graph of size {size}")

            def capture_end(self, timing):
                watch._end(("capture", name))

        return _Named()

    # steps end in the order they began (one step ahead at most): a FIFO of begun steps per key
    def _begin(self, key, what: str) -> None:
        with self._lock:
            self._open.setdefault(key, [])
            self._open[key].append((time.monotonic(), what))

    def _end(self, key) -> None:
        with self._lock:
            if self._open.get(key):
                self._open[key].pop(0)

    def oldest(self) -> tuple[float, str] | None:
        """(seconds, what) of the longest-running begun step or capture, or None."""
        with self._lock:
            items = [q[0] for q in self._open.values() if q]
        if not items:
            return None
        start, what = min(items)
        return time.monotonic() - start, what

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            o = self.oldest()
            if o is None or o[0] <= self.limit:
                continue
            msg = (f"serve-bench: {o[1]} has not finished after {o[0]:.0f} s (--stall-seconds {self.limit:g}); the GPU is "
                   f"most likely stuck in a kernel that never returns. Python stacks follow; exiting with status "
                   f"{EXIT_STALLED}. Results of the runs that finished are in the --out file.")
            if self.on_stall is not None:
                self.on_stall(msg)
                return
            print(msg, file=self.stream, flush=True)
            faulthandler.dump_traceback(file=self.stream, all_threads=True)
            self.stream.flush()
            os._exit(EXIT_STALLED)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll + 1)
