"""Overlapped decode steps (``serving/overlap.py``): a decode step launched before the previous step's
tokens reach the host gives the same outputs, finish reasons and page accounting as steps run one at a
time, with end-of-sequence stops, length stops, preemption and a request whose logits turn NaN."""

import copy

import pytest
import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.model.tiny import tiny_model
from quantmla.serving.engine import Engine, EngineConfig
from quantmla.serving.graphs import EngineObserver
from quantmla.serving.overlap import PendingStep, source_rows
from quantmla.serving.scheduler import FINISHED, PENDING, Request, SamplingParams, Scheduler, Sequence, StepPlan

INT4 = QuantCacheConfig.of_bits(4, 4, 32, 16)


def _next(tokens):  # a deterministic fake model: the next token of a sequence
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97 + 3


def _seqs(eos_every: int | None):
    lens = [(40, 30), (90, 20), (10, 60), (64, 64), (33, 1), (120, 8), (5, 40)]
    eos = [set() if eos_every is None else {t for t in range(3, 100) if t % eos_every == i % eos_every}
           for i in range(len(lens))]
    return [Sequence(Request(f"r{i}", list(range(3, 3 + p)), SamplingParams(max_new_tokens=o)), i, eos[i])
            for i, (p, o) in enumerate(lens)]


def _check_pages(sched):
    owned = [p for s in sched.running for p in s.pages]
    assert len(owned) == len(set(owned)) and len(owned) + sched.alloc.free == sched.num_pages


def _drive(sched, seqs):
    """Steps one at a time: schedule, sample, commit."""
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        plan = sched.schedule()
        _check_pages(sched)
        sched.commit(plan, [_next(it.seq.tokens[: it.start + it.n]) if it.sample else None for it in plan.items])


def _drive_ahead(sched, seqs):
    """The engine's overlapped loop with the fake model as the device: a pure decode step is launched (its
    tokens sampled, a pending input token taken from the step in flight) before the previous one resolves."""
    for s in seqs:
        sched.add(s)
    pending, ahead = None, 0
    while sched.has_unfinished() or pending is not None:
        plan = sched.schedule() if sched.has_unfinished() else StepPlan([], [])
        _check_pages(sched)
        src = source_rows(plan, pending) if plan.is_decode else None
        if src is not None:
            toks = []
            for it, r in zip(plan.items, src):
                seen = it.seq.tokens[: it.start + 1]
                if r >= 0:
                    seen = seen[:-1] + [pending.launch[r]]
                assert PENDING not in seen
                toks.append(_next(seen))
            if pending is not None:
                sched.resolve(pending.plan, pending.index, pending.launch, {})
            pending, ahead = PendingStep(plan, sched.commit_ahead(plan), toks, 0.0, 0.0), ahead + 1
            continue
        if pending is not None:
            sched.resolve(pending.plan, pending.index, pending.launch, {})
            pending = None
            plan.items = [it for it in plan.items if it.seq.status != FINISHED]
        for it in plan.items:
            assert PENDING not in it.seq.tokens  # steps not launched ahead only ever see real tokens
        sched.commit(plan, [_next(it.seq.tokens[: it.start + it.n]) if it.sample else None for it in plan.items])
    return ahead


@pytest.mark.parametrize("num_pages,max_tokens,max_seqs", [(200, 512, 64), (12, 48, 8)])
@pytest.mark.parametrize("eos_every", [7, None])
def test_scheduler_ahead_gives_the_same_outputs(num_pages, max_tokens, max_seqs, eos_every):
    outs = []
    for drive in (_drive, _drive_ahead):
        sched = Scheduler(num_pages, 16, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, watermark=0.0)
        seqs = _seqs(eos_every)
        ahead = drive(sched, seqs)
        assert sched.alloc.free == sched.num_pages and len(sched.finished) == len(seqs)  # every page came back
        got = [s.output() for s in seqs]
        assert sched.stats.output_tokens == sum(len(o.output_ids) for o in got)  # no token counted twice
        outs.append(([(o.output_ids, o.finish_reason) for o in got], sched.stats.preemptions))
        if drive is _drive_ahead:
            assert ahead > 0
    assert outs[0][0] == outs[1][0]
    reasons = {r for _, r in outs[0][0]}
    assert ("eos" in reasons) == (eos_every == 7) and "length" in reasons
    if num_pages == 12 and eos_every is None:
        assert outs[0][1] > 0 and outs[1][1] > 0  # preemption happened on both paths


def test_commit_ahead_and_resolve():
    sched = Scheduler(10, 16, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0)
    a = Sequence(Request("a", [5, 6, 7], SamplingParams(max_new_tokens=1)), 0, {9})
    b = Sequence(Request("b", [5, 6], SamplingParams(max_new_tokens=5)), 1, {9})
    c = Sequence(Request("c", [4], SamplingParams(max_new_tokens=5)), 2, {9})
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    idx = sched.commit_ahead(plan)
    assert idx == [3, 2, 1] and [s.tokens[-1] for s in (a, b, c)] == [PENDING] * 3
    assert a.status == FINISHED and a.finish_reason == "length" and a.pages == []  # its length is reached now
    assert sched.alloc.free == 10 - 2
    sched.resolve(plan, idx, [9, 9, 11], {2: "logits hold NaN"})
    assert a.tokens[-1] == 9 and a.finish_reason == "length"  # length first, as commit() decides
    assert b.finish_reason == "eos" and b.output().output_ids == [9] and b.pages == []
    assert c.finish_reason == "error" and c.output().output_ids == [] and c.error == "logits hold NaN"
    assert sched.alloc.free == 10 and not sched.has_unfinished()
    assert sched.stats.output_tokens == 2 and sched.stats.failed == 1


def _prompts(lens, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _engine(model, overlap, num_pages, backend="torch"):
    return Engine(model, EngineConfig(quant=INT4, num_pages=num_pages, page_size=16, max_num_batched_tokens=20,
                                      backend=backend, cuda_graphs="emulate", graph_buckets=(1, 2, 4),
                                      overlap_steps=overlap))


class Seen(EngineObserver):
    def __init__(self):
        self.begun, self.ended = [], []

    def step_begin(self, plan):
        self.begun.append(id(plan))

    def step_end(self, timing):
        self.ended.append(id(timing.plan))


def test_engine_overlap_gives_the_same_outputs(v3):
    prompts = _prompts((40, 3, 25, 50, 12), seed=5)
    with _engine(v3, False, 100) as e:
        ref = e.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    eos = ref[1].output_ids[4]  # request 1 stops at its fifth token (and any other that samples it)
    reqs = [Request(f"q{i}", p, SamplingParams(max_new_tokens=16 - i, eos_token_id=eos)) for i, p in enumerate(prompts)]
    for pages in (100, 5):  # roomy, and tight enough to preempt
        got = {}
        for overlap in (False, True):
            with _engine(v3, overlap, pages) as e:
                seen = Seen()
                e.observers.append(seen)
                outs = e.generate(reqs)
                got[overlap] = [(o.output_ids, o.finish_reason) for o in outs]
                st = e.stats
            assert st.graph_steps > 0 and st.output_tokens == sum(len(o.output_ids) for o in outs)
            assert seen.begun == seen.ended and len(seen.begun) >= st.graph_steps  # every step begun ends, in order
            if pages == 5:
                assert st.scheduler.preemptions > 0
        assert got[True] == got[False]
        assert got[True][1] == (ref[1].output_ids[:5], "eos")


def test_engine_overlap_nonfinite_decode_token_fails_that_request_alone(v3):
    """A request whose fourth output token has a NaN embedding: the decode step that reads it (launched
    ahead, its input taken from the step before on the device) gives NaN logits, the request fails with
    its first four tokens, the others complete as without overlap."""
    prompts = _prompts((12, 30, 9, 21), seed=4)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with _engine(v3, False, 40, "triton") as e:
        ref = [o.output_ids for o in e.generate(prompts, params)]
    bad = ref[3][3]
    others = {t for k in (0, 1, 2) for t in prompts[k] + ref[k]} | set(prompts[3]) | set(ref[3][:3])
    assert bad not in others  # the seed keeps the poisoned token away from every other input
    model = copy.deepcopy(v3)
    with torch.no_grad():
        model.get_input_embeddings().weight[bad] = float("nan")
    got = {}
    for overlap in (False, True):
        with _engine(model, overlap, 40, "triton") as e:  # the torch backend's writer refuses NaN records
            got[overlap] = [(o.output_ids, o.finish_reason) for o in e.generate(prompts, params)]
            assert e.stats.failed == 1 and e.stats.completed == 3 and e.stats.graph_steps > 0
    assert got[True] == got[False]
    assert got[True][3] == (ref[3][:4], "error") and [got[True][k][0] for k in (0, 1, 2)] == ref[:3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_overlap_on_gpu_with_graphs():
    """Real CUDA graphs: steps launched ahead take their input tokens from the previous replay's output on
    the device; outputs and finish reasons equal those of steps one at a time, buckets changing as requests
    stop on EOS or length, with preemption."""
    model = tiny_model("deepseek_v3", first_k_dense_replace=2).cuda()
    prompts = _prompts((7, 33, 90, 1, 20, 45), seed=4)
    cfg = dict(quant=INT4, page_size=16, max_num_batched_tokens=64, graph_buckets=(1, 2, 4, 8))
    with Engine(model, EngineConfig(num_pages=60, overlap_steps=False, **cfg)) as e:
        ref = e.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    eos = ref[2].output_ids[6]
    stop = ref[2].output_ids.index(eos) + 1  # its first occurrence ends request 2
    reqs = [Request(f"q{i}", p, SamplingParams(max_new_tokens=24 - 2 * i, eos_token_id=eos)) for i, p in enumerate(prompts)]
    for pages in (60, 14):
        got = {}
        for overlap in (False, True):
            with Engine(model, EngineConfig(num_pages=pages, overlap_steps=overlap, **cfg)) as e:
                got[overlap] = [(o.output_ids, o.finish_reason) for o in e.generate(reqs)]
                assert e.use_graphs and e.stats.graph_steps > 0, e.graph_error
        assert got[True] == got[False], [(a, b) for a, b in zip(got[True], got[False]) if a != b]
        assert got[True][2] == (ref[2].output_ids[:stop], "eos")


def test_resolve_finishes_a_sequence_preempted_after_its_step_was_committed_ahead():
    """The next schedule may preempt a sequence whose token is still pending; an EOS then finishes it in the
    waiting queue, and it is never admitted again."""
    from quantmla.serving.scheduler import WAITING

    sched = Scheduler(3, 16, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0)
    a = Sequence(Request("a", list(range(3, 18)), SamplingParams(max_new_tokens=10)), 0, {9})
    b = Sequence(Request("b", list(range(3, 18)), SamplingParams(max_new_tokens=10)), 1, {9})
    sched.add(a)
    sched.add(b)
    sched.commit(sched.schedule(), [5, 5])  # both prompts (15 tokens, one page each); one page left
    plan = sched.schedule()  # position 15 of each: still their first page
    idx = sched.commit_ahead(plan)
    nxt = sched.schedule()  # position 16 needs a second page each: b, the newest, is preempted
    assert nxt.preempted == [b] and b.status == WAITING and [it.seq for it in nxt.items] == [a]
    assert source_rows(nxt, PendingStep(plan, idx, None, 0.0, 0.0)) == [0]  # a's token comes from row 0
    sched.resolve(plan, idx, [11, 9], {})
    assert a.tokens[-1] == 11 and a.status != FINISHED
    assert b.finish_reason == "eos" and b.output().output_ids == [5, 9] and b not in sched.waiting
    assert len(a.pages) == 2 and sched.alloc.free == 1  # a took the free page, b's came back: nothing leaked
