"""serve-bench's stall watch: an engine step or graph capture that runs past the limit (a GPU kernel that never
returns) ends the process with status 3, naming the method and the step, instead of running out of a time limit
without a word; steps that end in time are never reported."""

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from quantmla_lab.bench.serving.stall import EXIT_STALLED, StallWatch

ROOT = Path(__file__).resolve().parents[1]


def plan(n):
    return SimpleNamespace(is_decode=True, items=list(range(n)), num_tokens=n)


def wait_for(cond, seconds=5.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not cond():
        time.sleep(0.01)
    return cond()


def test_a_step_past_the_limit_is_reported_with_its_method():
    seen = []
    watch = StallWatch(0.2, poll=0.02, on_stall=seen.append)
    obs = watch.observer("int4/int4")
    obs.step_begin(plan(8))
    assert wait_for(lambda: seen)
    watch.close()
    assert "int4/int4: a decode step of 8 sequences (8 tokens) has not finished" in seen[0]
    assert "--stall-seconds 0.2" in seen[0]


def test_steps_and_captures_that_end_in_time_are_never_reported():
    seen = []
    watch = StallWatch(0.3, poll=0.02, on_stall=seen.append)
    a, b = watch.observer("bf16"), watch.observer("fp8")
    for _ in range(20):  # one step ahead, as overlapped decode steps run: each ends within the limit
        a.step_begin(plan(2))
        b.capture_begin("decode", 4)
        time.sleep(0.02)
        a.step_end(None)
        b.capture_end(None)
    a.step_begin(plan(2))
    a.step_begin(plan(2))
    a.step_end(None)  # steps end in the order they began: the second is still open
    assert watch.oldest()[1].startswith("bf16: a decode step")
    a.step_end(None)
    assert watch.oldest() is None
    time.sleep(0.5)  # past the limit, with nothing open
    watch.close()
    assert seen == []


def test_a_stuck_process_exits_with_status_3_and_its_stacks():
    code = ("import time; from types import SimpleNamespace as S\n"
            "from quantmla_lab.bench.serving.stall import StallWatch\n"
            "w = StallWatch(0.3, poll=0.05).observer('int2/int4')\n"
            "w.capture_begin('decode', 16)\n"
            "time.sleep(30)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'lab'}", "PATH": "/usr/bin:/bin"})
    assert r.returncode == EXIT_STALLED, r.stderr
    assert time.monotonic() - t0 < 20
    assert "int2/int4: the capture of the decode graph of size 16 has not finished" in r.stderr
    assert "most likely stuck in a kernel" in r.stderr and "time.sleep" not in r.stdout
    assert 'File "<string>", line 5' in r.stderr  # the main thread's stack, where it waits


def test_a_limit_must_be_positive():
    with pytest.raises(ValueError, match="positive seconds"):
        StallWatch(0)
