"""Kernel compiles inside a timed run: Triton's JIT specializations and nvcc's builds of the CUDA decode kernel.

A Triton kernel compiles (or loads from Triton's on-disk cache) the first time a process launches it with a new
specialization: other constexprs, or an integer argument that changes class (1, a multiple of 16, anything else).
nvcc builds a decode-kernel cubin the first time any process on the machine needs its constants
(``quantmla.kernels.cuda.build.BUILDS``). Either can take a second, inside whichever step first needs it.
serve-bench warms each engine up on its job's shapes before timing it; the watch records what still compiled
inside the timed run, so a throughput figure never includes compile time unseen.
"""

from __future__ import annotations

import threading
import time
from collections import Counter


class CompileWatch:
    """Counts Triton compiles (through ``triton.knobs.runtime``'s JIT hooks, chained to any hooks already set)
    and nvcc builds while installed (``with CompileWatch() as w:``; once). ``count``, ``seconds`` and ``kernels``
    (kernel name -> compiles) grow as compiles happen; :meth:`snapshot` gives (count, seconds) to diff.
    ``triton_watched`` says whether this Triton has the hooks (False: Triton's compiles are not counted)."""

    def __init__(self):
        self.count, self.seconds, self.kernels = 0, 0.0, Counter()
        self.triton_watched = False
        self._started: dict[object, float] = {}  # a compile's key -> when its cache hook ran
        self._lock = threading.Lock()  # Triton's asynchronous compiles end on other threads
        self._knobs = self._prev = None
        self._builds: tuple[int, int | None] | None = None  # BUILDS[first:last] are this watch's (last: at exit)

    def __enter__(self) -> CompileWatch:
        from quantmla.kernels.cuda import build

        if self._builds is not None:
            raise RuntimeError("a CompileWatch is installed once; make another for another run")
        self._builds = (len(build.BUILDS), None)
        try:
            from triton import knobs

            prev = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        except (ImportError, AttributeError):  # no Triton, or one without these hooks: nvcc builds only
            return self
        self._knobs, self._prev, self.triton_watched = knobs.runtime, prev, True
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc) -> None:
        from quantmla.kernels.cuda import build

        self._builds = (self._builds[0], len(build.BUILDS))
        if self._knobs is not None:
            if self._knobs.jit_cache_hook == self._before:  # (a hook set since then stays)
                self._knobs.jit_cache_hook = self._prev[0]
            if self._knobs.jit_post_compile_hook == self._after:
                self._knobs.jit_post_compile_hook = self._prev[1]
            self._knobs = None

    def _before(self, **kw):
        prev = self._prev[0]
        skip = prev(**kw) if prev is not None else None
        if not skip:  # (a truthy answer tells Triton not to compile: no post-compile hook follows)
            with self._lock:
                self._started[kw.get("key")] = time.perf_counter()
        return skip

    def _after(self, **kw):
        now = time.perf_counter()
        fn = kw.get("fn")
        with self._lock:
            t0 = self._started.pop(kw.get("key"), now)
            self.count += 1
            self.seconds += now - t0
            self.kernels[getattr(fn, "name", None) or str(fn)] += 1
        prev = self._prev[1]
        return prev(**kw) if prev is not None else None

    def _new_builds(self) -> list[tuple[str, float]]:
        from quantmla.kernels.cuda import build

        if self._builds is None:
            return []
        first, last = self._builds
        return build.BUILDS[first:last]

    def snapshot(self) -> tuple[int, float]:
        """(compiles, seconds) so far: Triton's while installed plus nvcc's builds in that time."""
        new = self._new_builds()
        with self._lock:
            return self.count + len(new), self.seconds + sum(s for _, s in new)

    def summary(self) -> dict:
        """What compiled while the watch was installed: compiles and seconds in all (compiles after a run's last
        step included), Triton's compiles by kernel name, nvcc's builds, and whether Triton's were watched."""
        n, s = self.snapshot()
        return {"count": n, "seconds": round(s, 3), "triton_kernels": dict(sorted(self.kernels.items())),
                "nvcc_builds": len(self._new_builds()), "triton_watched": self.triton_watched}
