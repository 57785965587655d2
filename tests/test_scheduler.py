"""The scheduler alone, with a fake deterministic model: every page comes back, preemption by recompute loses and
repeats nothing, admission by free pages, and its accounting of recomputed tokens."""

from quantmla.serving.scheduler import Request, SamplingParams, Scheduler, Sequence


def _fake_next(tokens):
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97 + 3


def _drive(sched: Scheduler, seqs, check_invariants=True):
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan.items, "empty step with unfinished requests"
        assert plan.num_tokens <= sched.max_tokens and len(plan.items) <= sched.max_num_seqs
        if check_invariants:
            owned = [p for s in sched.running for p in s.pages]
            assert len(owned) == len(set(owned)), "a page is owned twice"
            assert len(owned) + sched.alloc.free == sched.num_pages
            for it in plan.items:
                assert len(it.seq.pages) * sched.page_size >= it.start + it.n  # room for this step's writes
        sampled = [_fake_next(it.seq.tokens) if it.sample else None for it in plan.items]
        sched.commit(plan, sampled)
    assert sched.alloc.free == sched.num_pages  # every page came back


def test_scheduler_preemption_loses_and_duplicates_nothing():
    lens = [(40, 30), (90, 20), (10, 60), (64, 64), (33, 1), (120, 8), (5, 40)]

    def run(num_pages, max_tokens, max_seqs):
        sched = Scheduler(num_pages, 16, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, watermark=0.0)
        seqs = [Sequence(Request(f"r{i}", list(range(3, 3 + p)), SamplingParams(max_new_tokens=o, ignore_eos=True)), i, set())
                for i, (p, o) in enumerate(lens)]
        _drive(sched, seqs)
        return sched, [s.output() for s in seqs]

    roomy, ref = run(200, 512, 64)
    assert roomy.stats.preemptions == 0
    tight, got = run(12, 48, 8)  # 192 tokens of cache for sequences of up to 128 tokens
    assert tight.stats.preemptions > 0 and tight.stats.recomputed_tokens > 0
    assert [o.request_id for o in got] == [f"r{i}" for i in range(len(lens))]
    for a, b, (p, o) in zip(got, ref, lens):
        assert a.ok and a.finish_reason == "length" and len(a.output_ids) == o
        assert a.output_ids == b.output_ids  # recompute reproduces the same continuation, nothing lost or repeated
    assert sum(s.preemptions for s in tight.finished) == tight.stats.preemptions
    assert len(tight.finished) == len(lens)


def test_recompute_counts_no_cached_prefix():
    """A preempted request with a cached prefix of 30 computes those positions the first time when it comes back:
    only the positions it had computed (30 on) count as recomputed (the prefix counted too: 32 instead of 2)."""
    sched = Scheduler(4, 16, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0)
    a = Sequence(Request("a", [5] * 30, SamplingParams(max_new_tokens=20, ignore_eos=True)), 0, set())
    b = Sequence(Request("b", [5] * 31, SamplingParams(max_new_tokens=10, ignore_eos=True), cached_prefix=30), 1, set())
    for s in (a, b):
        sched.add(s)
    computed_before = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        if b.preemptions and "b" not in computed_before:
            computed_before["b"] = b.high - 30  # positions b had computed past its prefix when preempted
        sched.commit(plan, [7 if it.sample else None for it in plan.items])
    assert b.preemptions == 1 and sched.stats.recomputed_tokens == computed_before["b"] == 2


def test_scheduler_admits_by_free_pages_and_fails_what_never_fits():
    sched = Scheduler(10, 16, max_num_seqs=8, max_num_batched_tokens=1000, watermark=0.0)
    big = Sequence(Request("big", [5] * 150, SamplingParams(max_new_tokens=20)), 0, set())  # 169 tokens > 160
    a = Sequence(Request("a", [5] * 70, SamplingParams(max_new_tokens=5)), 1, set())  # 5 pages
    b = Sequence(Request("b", [5] * 70, SamplingParams(max_new_tokens=5)), 2, set())  # 5 pages
    c = Sequence(Request("c", [5] * 20, SamplingParams(max_new_tokens=5)), 3, set())
    for s in (big, a, b, c):
        sched.add(s)
    assert big.finish_reason == "error" and "can never fit" in big.error and "10 pages" in big.error
    plan = sched.schedule()
    assert [it.seq.req.request_id for it in plan.items] == ["a", "b"]  # c waits: no free page left for it
    assert sched.alloc.free == 0 and c in sched.waiting
