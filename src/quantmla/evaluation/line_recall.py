"""Line recall: a retrieval format the reference models never trained on.

The key retrieval of :mod:`quantmla_lab.training.tasks` asks `<key> =`, the exact query form the models
trained on. Line recall asks something no training row asked: a stretch of held-out code (about
`length` tokens, whole lines) contains one line that appears nowhere else in it; the prompt ends
with the first half of that line (cut before a space near its middle), and the answer is the rest of
the line, scored greedy-exact token by token as :func:`retrieval_accuracy` does. The *control* is
the same prompt with the earlier line removed: what the model completes without the line in its
context, i.e. the chance level of guessing it from the code around it.

A sample: {"prompt_ids", "answer_ids", "control_prompt_ids"} (token ids [T]), "length" (the
nominal total in tokens), "depth" (the line's position in the context, 0 = start, 1 = end),
"line" (the text of the line).
"""

from __future__ import annotations

import random

MIN_CHARS = 24  # a line shorter than this (stripped) is too easy to guess
MIN_SIDE = 8  # characters on each side of the cut


def _cut(line: str) -> int | None:
    """The index of the space nearest the middle of the line's text with MIN_SIDE chars on both sides."""
    body_start = len(line) - len(line.lstrip())
    mid = (body_start + len(line)) // 2
    spaces = [i for i, ch in enumerate(line) if ch == " " and i - body_start >= MIN_SIDE and len(line) - i > MIN_SIDE]
    return min(spaces, key=lambda i: abs(i - mid)) if spaces else None


def _candidates(lines: list[str], lo: int, hi: int) -> list[int]:
    """Indices in [lo, hi) of lines that can be asked: long, unique, and whose second half appears
    nowhere else in the context (so only the line itself can give the answer)."""
    stripped = [l.strip() for l in lines]
    counts: dict[str, int] = {}
    for s in stripped:
        counts[s] = counts.get(s, 0) + 1
    out = []
    for i in range(lo, hi):
        s = stripped[i]
        if len(s) < MIN_CHARS or counts[s] != 1 or s.startswith("#") or not any(ch.isalpha() for ch in s):
            continue
        cut = _cut(lines[i])
        if cut is None:
            continue
        prefix, rest = lines[i][:cut].strip(), lines[i][cut:].strip()
        if any(j != i and (rest in lines[j] or prefix in lines[j]) for j in range(len(lines))):
            continue
        out.append(i)
    return out


def make_line_samples(tokenizer, texts: list[str], length: int, n: int, seed: int = 0) -> list[dict]:
    """`n` line-recall samples of at most `length` tokens (prompt + answer) from held-out documents
    `texts`, deterministic in `seed`. Fewer samples come back only when the text runs out of
    candidate lines (the caller reports how many it got)."""
    enc = lambda s: tokenizer(s, add_special_tokens=False, verbose=False)["input_ids"]  # noqa: E731
    lines_all: list[str] = []
    for t in texts:
        lines_all += [l for l in t.splitlines() if l.strip()]
    tok_len = [len(enc(l + "\n")) for l in lines_all]
    rng = random.Random(f"line-recall:{seed}:{length}")
    out, tries = [], 0
    while len(out) < n and tries < 20 * n:
        tries += 1
        start = rng.randrange(len(lines_all))
        ctx, total, i = [], 0, start
        while total < length - 48 and i < len(lines_all):
            ctx.append(lines_all[i])
            total += tok_len[i]
            i += 1
        if total < length // 2:
            continue
        cands = _candidates(ctx, len(ctx) // 10, max(len(ctx) // 2, 1))
        if not cands:
            continue
        k = rng.choice(cands)
        cut = _cut(ctx[k])
        prefix, answer = ctx[k][:cut], ctx[k][cut:]
        answer_ids = enc(answer)
        # trim from the end of the context (after the line) until prompt + answer fit `length`
        while True:
            body = "\n".join(ctx) + "\n"
            prompt_ids = enc(body + prefix)
            if len(prompt_ids) + len(answer_ids) <= length or len(ctx) <= k + 2:
                break
            ctx.pop()
        if len(prompt_ids) + len(answer_ids) > length:
            continue
        control = "\n".join(ctx[:k] + ctx[k + 1:]) + "\n" + prefix
        out.append({"prompt_ids": prompt_ids, "answer_ids": answer_ids, "control_prompt_ids": enc(control),
                    "length": length, "depth": round(k / len(ctx), 3), "line": ctx[k].strip()})
    return out


def line_recall(model, tokenizer, samples: list[dict], *, cache_factory=None, retrieval_fn=None) -> dict:
    """{"accuracy", "n", "correct", "control_accuracy", "control_correct"}: greedy-exact completions of the
    line with it in context, and with it removed (the control)."""
    if retrieval_fn is None:
        from quantmla.evaluation.retrieval import retrieval_accuracy as retrieval_fn
    r = retrieval_fn(model, tokenizer, [{"prompt_ids": s["prompt_ids"], "answer_ids": s["answer_ids"]} for s in samples],
                     cache_factory=cache_factory)
    c = retrieval_fn(model, tokenizer, [{"prompt_ids": s["control_prompt_ids"], "answer_ids": s["answer_ids"]}
                                        for s in samples], cache_factory=cache_factory)
    return {"accuracy": r["accuracy"], "n": r["n"], "correct": r["correct"],
            "control_accuracy": c["accuracy"], "control_correct": c["correct"]}
