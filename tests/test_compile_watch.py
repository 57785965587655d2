"""serve-bench's compile watch: Triton JIT compiles and nvcc builds inside a timed run, step by step."""

import os
import stat
import time
import types

import pytest

from quantmla.kernels.cuda import build
from quantmla_lab.bench.serving.compile_watch import CompileWatch
from quantmla_lab.bench.serving.step_log import StepLog

knobs = pytest.importorskip("triton.knobs")


def _compile(name: str, seconds: float = 0.0):
    """What Triton's JIT does around one compile: its cache hook, the compile, its post-compile hook."""
    kw = dict(key="k", repr=name, fn=types.SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
              already_compiled=False)
    if knobs.runtime.jit_cache_hook is not None:
        knobs.runtime.jit_cache_hook(**kw)
    time.sleep(seconds)
    if knobs.runtime.jit_post_compile_hook is not None:
        knobs.runtime.jit_post_compile_hook(**kw)


def test_compile_watch_counts_triton_compiles_and_keeps_other_hooks(monkeypatch):
    seen = []
    before, after = (lambda **kw: seen.append(("before", kw["repr"]))), (lambda **kw: seen.append(("after", kw["repr"])))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", before)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", after)
    _compile("outside")
    with CompileWatch() as w:
        _compile("mla_prefill_attention", 0.02)
        _compile("mla_prefill_attention")
        _compile("rope_kernel")
        n, s = w.snapshot()
    _compile("outside")
    assert (n, w.count) == (3, 3) and s >= 0.02 and w.seconds == s
    assert w.summary()["triton_kernels"] == {"mla_prefill_attention": 2, "rope_kernel": 1}
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (before, after)  # given back
    assert [r for _, r in seen].count("outside") == 4 and len(seen) == 10  # the hooks already set still ran


def test_compile_watch_skipped_compiles_and_hooks_set_meanwhile(monkeypatch):
    """A compile that a hook already set tells Triton to skip is not counted; a hook set while the watch is
    installed stays set after it; a watch is installed once."""
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: kw["repr"] == "skipped")
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    w = CompileWatch()
    with w:
        assert knobs.runtime.jit_cache_hook(key="k1", repr="skipped", fn=None) is True  # Triton stops there
        _compile("kept", 0.01)
        other = lambda **kw: None  # noqa: E731
        knobs.runtime.jit_post_compile_hook = other
    assert (w.count, w.kernels) == (1, {"kept": 1}) and w.summary()["triton_watched"]
    assert knobs.runtime.jit_post_compile_hook is other and knobs.runtime.jit_cache_hook(repr="skipped")
    with pytest.raises(RuntimeError, match="once"):
        w.__enter__()


def test_compile_watch_counts_nvcc_builds(tmp_path, monkeypatch):
    """A build that runs nvcc is counted; one found in the on-disk cache is not."""
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fake nvcc 0"; exit 0; fi\n'
                    'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then echo cubin > "$2"; fi; shift; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("QUANTMLA_CUDA_CACHE", str(tmp_path / "cubins"))
    build.compile_cubin((("A", 1),), "sm_90a")  # before the watch
    with CompileWatch() as w:
        build.compile_cubin((("A", 1),), "sm_90a")  # on disk already
        assert w.snapshot()[0] == 0
        build.compile_cubin((("A", 2),), "sm_90a")
        assert w.snapshot()[0] == 1 and w.summary()["nvcc_builds"] == 1
    build.compile_cubin((("A", 3),), "sm_90a")  # after the watch
    assert w.snapshot()[0] == 1 and w.summary()["nvcc_builds"] == 1


def test_step_log_puts_compiles_in_the_step_that_ends_next(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)

    def decode(rows):
        plan = types.SimpleNamespace(is_decode=True, items=[None] * rows)
        return types.SimpleNamespace(plan=plan, launch_s=1e-4, total_s=1e-3, kind="graph_decode")

    def prefill(n):
        seq = types.SimpleNamespace(prompt_len=n)
        item = types.SimpleNamespace(n=n, sample=True, start=0, seq=seq)
        return types.SimpleNamespace(plan=types.SimpleNamespace(is_decode=False, items=[item]), launch_s=0.01,
                                     total_s=0.02, kind="eager")

    with CompileWatch() as w:
        log = StepLog(w)
        _compile("a", 0.01)
        _compile("b")
        log.step_end(prefill(100))
        log.step_end(decode(2))
        _compile("c")
        log.step_end(decode(2))
        log.step_end(decode(3))
    out = log.summary()
    assert [p["compiles"] for p in out["prefill_steps"]] == [2] and out["prefill_steps"][0]["compile_ms"] >= 10
    assert {b: d["compiles"] for b, d in out["decode_by_batch"].items()} == {"2": 1, "3": 0}
    assert out["compiles"]["count"] == 3
