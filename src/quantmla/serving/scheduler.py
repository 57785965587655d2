"""Continuous batching over a fixed pool of cache pages: admission by free pages, chunked prefill,
batched decode, preemption by recompute.

Every sequence owns a list of page ids; the same ids index the page pool of every MLA layer.
Each step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. Running sequences, oldest admission first, each take their next tokens — one for a decoding
   sequence, a chunk of the rest of its prompt for a prefilling one. A decoding sequence that
   crosses a page boundary needs a new page; when none is free, the *newest* running sequence is
   preempted: its pages are freed and it goes back to the head of the waiting queue with its
   generated tokens kept, to be recomputed (prefilled again) on re-admission.
2. Waiting sequences, first come first served, are admitted while the pages for all their known
   tokens (prompt, plus outputs after a preemption) fit in the free pages above a watermark.
   Their pages are reserved at admission, so prefill chunks never allocate.

A step that processes a sequence's last known token samples one new token for it. A request whose
prompt plus outputs can never fit in the whole pool fails with a clear error at submission; the
others go on.

A step may be committed before its tokens reach the host (:meth:`Scheduler.commit_ahead`, for decode
steps the engine overlaps with the next): each sampled token is then ``PENDING`` in the sequence's
tokens, a sequence that reaches ``max_new_tokens`` finishes at once, and :meth:`Scheduler.resolve` writes
the tokens in later and finishes the sequences that sampled an end-of-sequence token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from quantmla.cache.paged import NULL_PAGE, PageAllocator
from quantmla.errors import QuantMLAError


PENDING = -2  # a sampled token still on the device (Scheduler.commit_ahead); never a token id


class RequestTooLargeError(QuantMLAError):
    """A request needs more cache pages than the whole pool holds."""


@dataclass
class SamplingParams:
    """Greedy decoding. ``max_new_tokens``: tokens to generate; ``ignore_eos``: keep going past EOS
    (benchmarks); ``eos_token_id``: stop token(s) (default: the model config's)."""

    max_new_tokens: int = 16
    ignore_eos: bool = False
    eos_token_id: int | list[int] | None = None


@dataclass
class Request:
    """A prompt (token ids) to continue. ``cached_prefix``: the first N prompt tokens count as already
    written to the cache, 0 <= N < len(prompt): the sequence's first step computes tokens N onwards, and
    its attention reads positions [0, N) from whatever its pages hold. A benchmark hook: it reaches a long
    context at decode without prefilling it (the outputs are then not the model's on this prompt). A
    preempted sequence recomputes its whole prompt."""

    request_id: object
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    cached_prefix: int = 0

    @property
    def positions(self) -> int:
        """Positions the request reaches: its prompt and every new token but the last (returned, never fed)."""
        return len(self.prompt) + self.params.max_new_tokens - 1


@dataclass
class RequestOutput:
    request_id: object
    prompt_len: int
    output_ids: list[int]
    finish_reason: str  # "length", "eos" or "error"
    error: str | None = None
    preemptions: int = 0
    logits: list | None = None  # per generated token (EngineConfig.keep_logits), for tests

    @property
    def ok(self) -> bool:
        return self.error is None


WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Sequence:
    """Scheduler state of one request."""

    __slots__ = ("req", "index", "tokens", "prompt_len", "num_computed", "pages", "status", "preemptions",
                 "admitted_at", "finish_reason", "error", "eos", "logits", "high")

    def __init__(self, req: Request, index: int, eos: set[int]):
        self.req, self.index = req, index
        self.tokens: list[int] = list(req.prompt)
        self.prompt_len = len(req.prompt)
        self.num_computed = req.cached_prefix  # tokens whose cache entries are written
        self.pages: list[int] = []  # grows in place only; preempting or finishing gives the sequence a new list
        self.status = WAITING
        self.preemptions = 0
        self.admitted_at = -1
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.eos = eos
        self.logits: list | None = None
        self.high = self.num_computed  # most tokens ever computed (recompute accounting)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Known tokens not yet in the cache."""
        return len(self.tokens) - self.num_computed

    def output(self) -> RequestOutput:
        return RequestOutput(self.req.request_id, self.prompt_len, self.tokens[self.prompt_len:],
                             self.finish_reason or "error", self.error, self.preemptions, self.logits)


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first token position computed this step
    n: int  # tokens computed this step
    sample: bool  # this step reaches the last known token: sample the next one


@dataclass
class StepPlan:
    items: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(i.n for i in self.items)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly one token and samples (a CUDA-graph-able step)."""
        return bool(self.items) and all(i.n == 1 and i.sample for i in self.items)


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    peak_batch: int = 0  # most sequences in one step
    peak_running: int = 0  # most sequences holding pages at once
    computed_tokens: int = 0  # prefill + decode tokens run through the model (recompute included)
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    output_tokens: int = 0
    failed: int = 0
    peak_pages_used: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Scheduler:
    def __init__(self, num_pages: int, page_size: int, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 watermark: float = 0.01, first_page: int = NULL_PAGE + 1):
        if num_pages < 1:
            raise QuantMLAError(f"the KV budget holds {num_pages} pages; give a budget of at least one page per layer")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise QuantMLAError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0.0 <= watermark < 1.0:
            raise QuantMLAError(f"watermark {watermark!r}: the fraction of pages admission leaves free, in [0, 1)")
        self.page_size = page_size
        self.alloc = PageAllocator(num_pages, first_page)
        self.num_pages = num_pages
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.watermark_pages = int(watermark * num_pages)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.finished: list[Sequence] = []
        self.stats = SchedulerStats()
        self._admissions = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # -- submission ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        p = seq.req.params
        if not seq.tokens:
            return self._fail(seq, "empty prompt: a request needs at least one token")
        if p.max_new_tokens < 1:
            return self._fail(seq, f"max_new_tokens must be >= 1, got {p.max_new_tokens}")
        if not 0 <= seq.req.cached_prefix < seq.prompt_len:
            return self._fail(seq, f"cached_prefix must lie in [0, {seq.prompt_len}) for a prompt of {seq.prompt_len} "
                                   f"tokens (the last prompt token is always computed), got {seq.req.cached_prefix}")
        need_tokens = seq.prompt_len + p.max_new_tokens - 1  # the last sampled token is never cached
        need = self.pages_for(need_tokens)
        if need > self.num_pages:
            return self._fail(seq, RequestTooLargeError(
                f"request {seq.req.request_id!r} can never fit: its {seq.prompt_len} prompt tokens + "
                f"{p.max_new_tokens} new tokens need {need} cache pages of {self.page_size} tokens, but the whole KV "
                f"budget holds {self.num_pages} pages; raise the KV budget, or shorten the prompt or max_new_tokens"
            ))
        self.waiting.append(seq)

    def fail_running(self, seq: Sequence, err) -> None:
        """Fail a running sequence (its step's result is unusable): its pages go back to the pool,
        :meth:`commit` then skips it."""
        self._retire(seq)
        self._fail(seq, err)

    def _fail(self, seq: Sequence, err) -> None:
        seq.status, seq.finish_reason, seq.error = FINISHED, "error", str(err)
        self.stats.failed += 1
        self.finished.append(seq)

    def _retire(self, seq: Sequence) -> None:
        """Take a sequence out of the running list or the waiting queue; its pages go back to the pool."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.alloc.release(seq.pages)
        seq.pages = []

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._retire(seq)
        seq.status, seq.finish_reason = FINISHED, reason
        self.finished.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self._retire(seq)
        seq.num_computed = 0
        seq.status = WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        budget = self.max_tokens
        items: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.remaining, budget)
            need = self.pages_for(seq.num_computed + n) - len(seq.pages)
            victim_self = False
            while need > self.alloc.free:
                victim = self.running[-1]
                if victim is seq:
                    victim_self = True
                    break
                if id(victim) in scheduled:  # cannot happen (victims are newer than seq), kept as a guard
                    raise RuntimeError("scheduler: tried to preempt a sequence already scheduled this step")
                self._preempt(victim)
                preempted.append(victim)
            if victim_self:
                self._preempt(seq)
                preempted.append(seq)
                continue  # running[i] is now the next sequence
            if need > 0:
                seq.pages += self.alloc.allocate(need)
            items.append(ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == len(seq.tokens)))
            scheduled.add(id(seq))
            budget -= n
            i += 1
        if not preempted:  # admit only when nothing had to be preempted this step
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                need = self.pages_for(len(seq.tokens))
                if need > self.alloc.free - (self.watermark_pages if self.running else 0):
                    break
                self.waiting.popleft()
                seq.pages = self.alloc.allocate(need)
                seq.status = RUNNING
                seq.admitted_at = self._admissions
                self._admissions += 1
                self.running.append(seq)
                n = min(seq.remaining, budget)
                items.append(ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == len(seq.tokens)))
                budget -= n
        st = self.stats
        st.steps += 1
        st.peak_batch = max(st.peak_batch, len(items))
        st.peak_running = max(st.peak_running, len(self.running))
        st.peak_pages_used = max(st.peak_pages_used, self.num_pages - self.alloc.free)
        plan = StepPlan(items, preempted)
        if plan.is_decode:
            st.decode_steps += 1
        for it in items:
            st.computed_tokens += it.n
            # positions computed before (a cached prefix never was: after a preemption it is computed the first time)
            first = max(it.start, it.seq.req.cached_prefix)
            st.recomputed_tokens += max(0, min(it.start + it.n, it.seq.high) - first)
        return plan

    def commit(self, plan: StepPlan, sampled: list[int | None], logits: list | None = None) -> list[Sequence]:
        """Record the step: advance computed counts, append sampled tokens, retire finished sequences."""
        done = []
        for k, it in enumerate(plan.items):
            seq = it.seq
            if seq.status == FINISHED:  # failed during this step (fail_running)
                continue
            seq.num_computed = it.start + it.n
            seq.high = max(seq.high, seq.num_computed)
            if not it.sample:
                continue
            tok = int(sampled[k])
            seq.tokens.append(tok)
            if logits is not None:
                if seq.logits is None:
                    seq.logits = []
                # after a preemption, recompute re-samples nothing: only new tokens get here
                seq.logits.append(logits[k])
            self.stats.output_tokens += 1
            p = seq.req.params
            if seq.num_generated >= p.max_new_tokens:
                self._finish(seq, "length")
                done.append(seq)
            elif not p.ignore_eos and tok in seq.eos:
                self._finish(seq, "eos")
                done.append(seq)
        return done

    def commit_ahead(self, plan: StepPlan) -> list[int]:
        """:meth:`commit` before the step's tokens reach the host: every sampling item gets ``PENDING`` for its
        token, and a sequence that reaches ``max_new_tokens`` finishes now (its pages go back to the pool: any
        later user of them writes after this step, in stream order). Returns, per item, the index of its
        pending token in ``seq.tokens`` (-1: none); :meth:`resolve` takes it."""
        index = []
        for it in plan.items:
            seq = it.seq
            if seq.status == FINISHED:
                index.append(-1)
                continue
            seq.num_computed = it.start + it.n
            seq.high = max(seq.high, seq.num_computed)
            if not it.sample:
                index.append(-1)
                continue
            index.append(len(seq.tokens))
            seq.tokens.append(PENDING)
            self.stats.output_tokens += 1
            if seq.num_generated >= seq.req.params.max_new_tokens:
                self._finish(seq, "length")
        return index

    def resolve(self, plan: StepPlan, index: list[int], sampled: list[int], errors: dict[int, str]) -> None:
        """The tokens of a plan committed ahead: ``sampled[k]`` replaces item k's pending token (``index[k]``).
        A sequence that sampled an end-of-sequence token finishes, wherever it now is (running, or preempted
        back to the waiting queue); ``errors`` (item -> message) fails an item's sequence instead. A sequence
        that had already finished by length keeps that reason, unless its last token failed."""
        for k, it in enumerate(plan.items):
            i, seq = index[k], it.seq
            if i < 0 or seq.tokens[i] != PENDING:
                continue
            tok = int(sampled[k])
            seq.tokens[i] = tok
            if k in errors:  # the token is not kept, as commit() never sees a failed sequence's
                del seq.tokens[i]
                self.stats.output_tokens -= 1
                if seq.status == FINISHED:  # by length: already retired and counted among the finished
                    seq.finish_reason, seq.error = "error", errors[k]
                    self.stats.failed += 1
                else:
                    self._retire(seq)
                    self._fail(seq, errors[k])
            elif seq.status != FINISHED and not seq.req.params.ignore_eos and tok in seq.eos:
                self._finish(seq, "eos")
