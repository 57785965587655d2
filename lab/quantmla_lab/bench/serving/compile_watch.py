"""Kernel compiles inside a timed run: Triton's JIT specializations and nvcc's builds of the CUDA decode kernel.

A Triton kernel compiles (or loads from Triton's on-disk cache) the first time a process launches it with a new
specialization: other constexprs, or an integer argument that changes class (1, a multiple of 16, anything else).
nvcc builds a decode-kernel cubin the first time any process on the machine needs its constants
(``quantmla.kernels.cuda.build.BUILDS``). Either can take a second, inside whichever step first needs it.
serve-bench warms each engine up on its job's shapes before timing it; the watch records what still compiled
inside the timed run, so a throughput figure never includes compile time unseen.
"""

from __future__ import annotations

import time
from collections import Counter


class CompileWatch:
    """Counts Triton compiles (through ``triton.knobs.runtime``'s JIT hooks, chained to any hooks already set)
    and nvcc builds while installed (``with CompileWatch() as w:``). ``count``, ``seconds`` and ``kernels``
    (kernel name -> compiles) grow as compiles happen; :meth:`snapshot` gives (count, seconds) to diff."""

    def __init__(self):
        self.count, self.seconds, self.kernels = 0, 0.0, Counter()
        self._started: list[float] = []
        self._knobs = self._prev = None
        self._builds0 = 0

    def __enter__(self) -> CompileWatch:
        from quantmla.kernels.cuda import build

        self._builds0 = len(build.BUILDS)
        try:
            from triton import knobs
        except ImportError:  # a Triton without knobs (or none): nvcc builds only
            return self
        self._knobs = knobs.runtime
        self._prev = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._prev
            self._knobs = None

    def _before(self, **kw):
        self._started.append(time.perf_counter())
        prev = self._prev[0]
        return prev(**kw) if prev is not None else None

    def _after(self, **kw):
        t0 = self._started.pop() if self._started else time.perf_counter()
        self.count += 1
        self.seconds += time.perf_counter() - t0
        fn = kw.get("fn")
        self.kernels[getattr(fn, "name", None) or str(fn)] += 1
        prev = self._prev[1]
        return prev(**kw) if prev is not None else None

    def snapshot(self) -> tuple[int, float]:
        """(compiles, seconds) so far: Triton's since the watch was installed plus nvcc's builds since then."""
        from quantmla.kernels.cuda import build

        new = build.BUILDS[self._builds0:]
        return self.count + len(new), self.seconds + sum(s for _, s in new)

    def summary(self) -> dict:
        """What compiled while the watch was installed: compiles and seconds in all, Triton's compiles by kernel
        name, and nvcc's builds."""
        from quantmla.kernels.cuda import build

        n, s = self.snapshot()
        return {"count": n, "seconds": round(s, 3), "triton_kernels": dict(sorted(self.kernels.items())),
                "nvcc_builds": len(build.BUILDS) - self._builds0}
