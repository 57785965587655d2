"""The engine's public hook: observers told of every step (with host timings and the step's kind) and
of every CUDA-graph capture; the graph buckets an engine holds."""

import pytest
import torch

from quantmla.errors import QuantMLAError
from quantmla.model.tiny import tiny_model
from quantmla.serving import graphs
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import CaptureTiming, EngineObserver, StepTiming
from quantmla.serving.scheduler import SamplingParams


class Recorder(EngineObserver):
    def __init__(self):
        self.events = []

    def step_begin(self, plan):
        self.events.append(("begin", plan))

    def step_end(self, timing):
        self.events.append(("end", timing))

    def capture_begin(self, graph, size):
        self.events.append(("capture_begin", graph, size))

    def capture_end(self, timing):
        self.events.append(("capture_end", timing))


def _prompts(lens, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _engine(model, **kw):
    cfg = dict(num_pages=12, page_size=16, backend="torch", cuda_graphs="emulate", graph_buckets=(1, 2, 4),
               max_num_batched_tokens=32)
    return Engine(model, EngineConfig(**{**cfg, **kw}))


def test_observer_sees_every_step_with_its_kind_and_timings(v3):
    prompts, params = _prompts((10, 40, 7, 25), seed=3), SamplingParams(max_new_tokens=6, ignore_eos=True)
    with _engine(v3) as plain:
        ref = [o.output_ids for o in plain.generate(prompts, params)]
    rec = Recorder()
    with _engine(v3) as eng:
        eng.observers.append(rec)
        outs = eng.generate(prompts, params)
        st = eng.stats
    assert [o.output_ids for o in outs] == ref  # observing changes nothing
    begins = [e[1] for e in rec.events if e[0] == "begin"]
    ends = [e[1] for e in rec.events if e[0] == "end"]
    assert len(begins) == len(ends) == st.scheduler.steps
    assert all(isinstance(t, StepTiming) for t in ends) and [t.plan for t in ends] == begins  # ends in step order
    # a decode step launched ahead begins before the previous one ends; never more than one step in flight
    open_steps = [sum(1 if e[0] == "begin" else -1 for e in rec.events[: i + 1]) for i in range(len(rec.events))]
    assert set(open_steps) <= {0, 1, 2} and 2 in open_steps
    assert all(rec.events[i + 1][0] == "end" for i, n in enumerate(open_steps[:-1]) if n == 2)
    kinds = [t.kind for t in ends]
    assert kinds.count("graph_decode") == st.graph_steps > 0
    assert kinds.count("prefill_graph") == st.prefill_graph_steps > 0
    assert kinds.count("eager") == st.eager_steps
    assert all(0 < t.launch_s <= t.total_s for t in ends if t.kind != "graph_decode")
    assert all(t.launch_s > 0 and t.total_s > 0 for t in ends)
    assert sum(t.total_s for t in ends if t.kind == "graph_decode") == pytest.approx(st.graph_decode_s)
    assert all(t.plan.is_decode for t in ends if t.kind == "graph_decode")


def test_observer_pairs_every_step_without_overlap(v3):
    prompts, params = _prompts((10, 40, 7, 25), seed=3), SamplingParams(max_new_tokens=6, ignore_eos=True)
    rec = Recorder()
    with _engine(v3, overlap_steps=False) as eng:
        eng.observers.append(rec)
        eng.generate(prompts, params)
        st = eng.stats
    assert [e[0] for e in rec.events] == ["begin", "end"] * st.scheduler.steps  # strictly paired, one per step
    ends = [e[1] for e in rec.events if e[0] == "end"]
    assert st.graph_steps > 0 and all(0 < t.launch_s <= t.total_s for t in ends)


def test_observed_capture_times_each_run_of_the_step(monkeypatch):
    """The capture hook on CPU, with the CUDA capture replaced by one that runs the step three times
    (warm-up, probe, capture) as the real one does."""
    calls = []

    def fake_capture(step, pool):
        outs = [step() for _ in range(3)]
        return "graph", outs[-1], None

    monkeypatch.setattr(graphs, "capture_step", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    rec = Recorder()

    class FakeEngine:
        observers = [rec]

    got = graphs.observed_capture(FakeEngine(), "decode", 8, lambda: 42, None)
    assert got == ("graph", 42, None) and calls == ["sync"]
    assert [e[0] for e in rec.events] == ["capture_begin", "capture_end"] and rec.events[0][1:] == ("decode", 8)
    t = rec.events[1][1]
    assert isinstance(t, CaptureTiming) and (t.graph, t.size, t.ok) == ("decode", 8, True)
    assert len(t.runs_s) == 3 and all(r >= 0 for r in t.runs_s) and t.capture_s >= sum(t.runs_s)

    FakeEngine.observers = []  # no observers: the capture alone, no synchronization
    assert graphs.observed_capture(FakeEngine(), "decode", 8, lambda: 7, None) == ("graph", 7, None)
    assert calls == ["sync"]


def test_graph_buckets_an_engine_holds(v3):
    with _engine(v3) as eng:
        assert eng.graph_count == 0
        eng.generate(_prompts((10, 7), seed=1), SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert eng.graph_count > 0
        assert eng.decode_graph(3) == (4, None)  # emulated: the bucket, no CUDA graph
        with pytest.raises(QuantMLAError, match="no graph bucket"):
            eng.decode_graph(5)


@pytest.mark.parametrize("replace", ["module", "data"])
def test_graphs_are_dropped_when_a_weight_is_replaced_between_jobs(replace):
    """A module swapped at its owner or a weight's storage replaced after a job: the engine holds no graphs (they
    read the old storage) and the next job captures them again and computes with the new weights, as a fresh
    engine does. An in-place update keeps them."""
    prompts, params = _prompts((10, 7), seed=2), SamplingParams(max_new_tokens=5, ignore_eos=True)
    v3 = tiny_model("deepseek_v3")  # its own: the module's shared model stays as it is
    attn = v3.model.layers[0].self_attn
    kept = attn.kv_a_proj_with_mqa
    with _engine(v3) as eng:
        eng.generate(prompts, params)
        held = eng.graph_count
        assert held > 0
        with torch.no_grad():
            kept.weight.mul_(1.0)
        assert eng.graph_count == held
        if replace == "module":
            new = torch.nn.Linear(kept.in_features, kept.out_features, bias=kept.bias is not None)
            with torch.no_grad():
                new.weight.copy_(kept.weight.flip(0))
            attn.kv_a_proj_with_mqa = new
        else:
            kept.weight.data = kept.weight.data.flip(0)
        assert eng.graph_count == 0
        got = [o.output_ids for o in eng.generate(prompts, params)]
        assert eng.graph_count > 0
    with _engine(v3) as fresh:
        want = [o.output_ids for o in fresh.generate(prompts, params)]
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_observer_sees_every_capture_on_gpu():
    """Dense MLPs (capturable): every capture is told with its three timed runs, and the engine hands
    out the decode graph a step replays."""
    model = tiny_model("deepseek_v3", first_k_dense_replace=2).cuda()
    rec = Recorder()
    with Engine(model, EngineConfig(num_pages=12, page_size=16, backend="triton", graph_buckets=(1, 2, 4),
                                    max_num_batched_tokens=32)) as eng:
        eng.observers.append(rec)
        eng.generate(_prompts((10, 7), seed=1), SamplingParams(max_new_tokens=4, ignore_eos=True))
        eng.capture_graphs()  # the buckets the job did not use
        caps = [e[1] for e in rec.events if e[0] == "capture_end"]
        begins = [e[1:] for e in rec.events if e[0] == "capture_begin"]
        assert caps and [(t.graph, t.size) for t in caps] == begins
        assert all(t.ok and len(t.runs_s) == 3 and t.capture_s >= sum(t.runs_s) for t in caps), caps
        assert len(caps) == eng.graph_count and {t.size for t in caps if t.graph == "decode"} == {1, 2, 4}
        bucket, graph = eng.decode_graph(3)
        assert bucket == 4 and isinstance(graph, torch.cuda.CUDAGraph)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("replace", ["module", "data"])
def test_graphs_are_captured_again_after_a_weight_swap_on_gpu(replace):
    """Real CUDA graphs read the storage they were captured over: after a module or a weight's storage is replaced
    between jobs the engine captures them again (the observer sees new captures) and its tokens are a fresh
    engine's."""
    model = tiny_model("deepseek_v3", first_k_dense_replace=2).cuda()
    prompts, params = _prompts((10, 7), seed=4), SamplingParams(max_new_tokens=6, ignore_eos=True)
    cfg = EngineConfig(num_pages=12, page_size=16, backend="triton", graph_buckets=(1, 2, 4), max_num_batched_tokens=32)
    attn = model.model.layers[1].self_attn
    rec = Recorder()
    with Engine(model, cfg) as eng:
        eng.observers.append(rec)
        eng.generate(prompts, params)
        first = sum(e[0] == "capture_end" for e in rec.events)
        assert first > 0 and eng.graph_count > 0
        old = attn.kv_a_proj_with_mqa
        if replace == "module":
            new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None).cuda()
            with torch.no_grad():
                new.weight.copy_(old.weight.flip(0))
            attn.kv_a_proj_with_mqa = new
        else:
            old.weight.data = old.weight.data.flip(0).contiguous()
        got = [o.output_ids for o in eng.generate(prompts, params)]
        assert sum(e[0] == "capture_end" for e in rec.events) > first
    with Engine(model, cfg) as fresh:
        want = [o.output_ids for o in fresh.generate(prompts, params)]
    assert got == want
