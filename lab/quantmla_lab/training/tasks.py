"""Synthetic long-range retrieval buried in real code.

Format (the same in training and evaluation). Key-value lines are inserted at line starts
(before a line that begins in column 0) of a stretch of real Python code::

    amber_falcon = 48213

and the text ends with the key of one of them, the value is the answer::

    ...real code...
    amber_falcon =          <- prompt ends here
     48213                  <- answer (" 48213"), scored token by token

Keys are ``<adjective>_<animal>`` with distinct adjectives and animals inside one sample,
values are uniform 5-digit numbers, so nothing but the inserted line can give the answer.
With the GPT-2 byte-level pre-tokenizer a key line tokenizes the same wherever it is put
(see :func:`quantmla_lab.training.tokenizer.line_start_tokens`), so training rows are built at
the token level (fast, no tokenizer in the loop) and evaluation samples as text.

Evaluation samples (:func:`make_eval_samples`): ``n_keys`` key lines (default 4: one asked
for, three distractors) at uniformly random line starts, one query, total length (prompt +
answer tokens) within a few tokens below the nominal length.
Training rows (:class:`RowMaker`): 1-6 key lines inside the last ``span`` tokens of a row,
then 1..n_keys queries (each answered), loss on answers weighted by ``answer_weight``.
"""

from __future__ import annotations

import random

import numpy as np

ADJECTIVES = (
    "amber azure bold brave bright calm clever coral crimson curly dusty eager fancy fuzzy "
    "gentle golden happy hidden icy ivory jolly lazy lucky mellow misty noble olive pale "
    "proud quiet rapid rosy royal rusty scarlet shiny silent silver sleepy snowy steady "
    "stormy sunny swift tiny violet wild windy"
).split()
ANIMALS = (
    "badger beaver bison camel cobra condor crane dingo eagle falcon ferret finch gecko "
    "heron hyena ibis iguana jackal koala lemur llama lynx magpie marmot moose newt ocelot "
    "otter panda parrot pelican puffin python quail raven salmon seal shark sloth stork "
    "tapir tiger toucan turtle walrus wombat yak zebra"
).split()
VALUE_LO, VALUE_HI = 10000, 99999


def key_names() -> list[str]:
    return [f"{a}_{b}" for a in ADJECTIVES for b in ANIMALS]


def _pick_keys(rng: random.Random, n: int) -> list[str]:
    adj = rng.sample(ADJECTIVES, n)
    ani = rng.sample(ANIMALS, n)
    return [f"{a}_{b}" for a, b in zip(adj, ani)]


def _line_starts(text: str) -> list[int]:
    """Offsets of lines that begin in column 0 with a non-space character (not offset 0)."""
    return [i + 1 for i, ch in enumerate(text[:-1]) if ch == "\n" and not text[i + 1].isspace()]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def make_eval_sample(rng: random.Random, tokenizer, pool: list[str], n_tokens: int, n_keys: int = 4) -> dict:
    """One retrieval sample of about ``n_tokens`` tokens (prompt + answer) from code ``pool``."""
    for _attempt in range(20):
        keys = _pick_keys(rng, n_keys)
        values = [rng.randint(VALUE_LO, VALUE_HI) for _ in keys]
        ask = rng.randrange(n_keys)
        lines = [f"{k} = {v}\n" for k, v in zip(keys, values)]
        query, answer = f"{keys[ask]} =", f" {values[ask]}"
        extra = sum(len(_ids(tokenizer, s)) for s in lines) + len(_ids(tokenizer, query)) + len(_ids(tokenizer, answer))
        # Enough code: consecutive pool documents from a random one, joined by a blank line.
        start = rng.randrange(len(pool))
        parts, chars, i = [], 0, start
        while chars < 6 * n_tokens + 2000 and i < start + len(pool):
            doc = pool[i % len(pool)]
            parts.append(doc if doc.endswith("\n") else doc + "\n")
            chars += len(parts[-1])
            i += 1
        text = "\n".join(parts)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        budget = n_tokens - extra
        for _shrink in range(6):
            if budget <= 16 or budget > len(enc["input_ids"]):
                break
            cut = enc["offset_mapping"][budget - 1][1]
            nl = text.rfind("\n", 0, cut)
            if nl <= 0:
                break
            context = text[: nl + 1]
            starts = _line_starts(context)
            if len(starts) < n_keys:
                break
            where = sorted(rng.sample(starts, n_keys))
            order = list(range(n_keys))
            rng.shuffle(order)  # which key line goes where
            pieces, prev = [], 0
            for slot, pos in enumerate(where):
                pieces += [context[prev:pos], lines[order[slot]]]
                prev = pos
            pieces.append(context[prev:])
            prompt = "".join(pieces) + query
            p_ids, a_ids = _ids(tokenizer, prompt), _ids(tokenizer, answer)
            total = len(p_ids) + len(a_ids)
            if total > n_tokens:
                budget -= total - n_tokens + 2
                continue
            if _ids(tokenizer, prompt + answer) != p_ids + a_ids:
                break  # tokenization not separable here: try another sample
            slot_of_ask = order.index(ask)
            depth = where[slot_of_ask] / max(len(context), 1)
            return {
                "length": n_tokens,
                "n_tokens": total,
                "prompt": prompt,
                "answer": answer,
                "key": keys[ask],
                "n_keys": n_keys,
                "depth": round(depth, 4),
            }
    raise RuntimeError("could not build a retrieval sample: the code pool is too small")


def make_eval_samples(tokenizer, pool: list[str], n_tokens: int, n: int, seed: int = 0, n_keys: int = 4,
                      tag: str = "retrieval") -> list[dict]:
    """``n`` deterministic samples (``tag``, ``seed`` and ``n_tokens`` fix them)."""
    rng = random.Random(f"{tag}:{seed}:{n_tokens}")
    out = []
    for i in range(n):
        s = make_eval_sample(rng, tokenizer, pool, n_tokens, n_keys)
        s["id"] = f"{tag[0]}{n_tokens}-{i:04d}"
        out.append(s)
    return out


class RowMaker:
    """Builds training rows (token ids + per-token loss weights) from a token stream.

    ``stream``: uint16/int32 token ids of the packed training documents. A plain row is a
    random window of the stream; a retrieval row is a window that ends at a line start,
    with key lines spliced in at line starts of its last ``span`` tokens and queries appended.
    Weights (aligned with ids, weight ``w[t]`` is for predicting token ``t``): 1 on code,
    0 on inserted key lines and on the query keys (random, unpredictable),
    ``answer_weight`` on answer tokens.
    """

    def __init__(self, tokenizer, stream: np.ndarray, answer_weight: float = 1.0):
        from quantmla_lab.training.tokenizer import line_start_tokens

        self.stream = stream
        self.answer_weight = float(answer_weight)
        names = key_names()
        self.names = names
        self.name_index = {n: i for i, n in enumerate(names)}
        enc = tokenizer.backend_tokenizer.encode_batch([f"{n} =" for n in names], add_special_tokens=False)
        self.name_ids = [np.asarray(e.ids, dtype=np.int64) for e in enc]
        vals = [f" {v}" for v in range(VALUE_LO, VALUE_HI + 1)]
        enc = tokenizer.backend_tokenizer.encode_batch(vals, add_special_tokens=False)
        self.value_ids = [np.asarray(e.ids, dtype=np.int64) for e in enc]
        nl = _ids(tokenizer, "\n")
        assert len(nl) == 1, "newline must be one token"
        self.nl = np.asarray(nl, dtype=np.int64)
        ends, blank = line_start_tokens(tokenizer)
        # positions p after which a column-0 line starts (token p ends a line, p+1 is not blank)
        self.line_pos = np.flatnonzero(ends[stream[:-1]] & ~blank[stream[1:]])

    def plain_row(self, rng: np.random.Generator, T: int):
        s = int(rng.integers(0, len(self.stream) - T))
        return self.stream[s : s + T].astype(np.int64), np.ones(T, dtype=np.float32)

    def retrieval_row(self, rng: np.random.Generator, T: int, span: int, max_keys: int = 6):
        n_keys = int(rng.integers(1, max_keys + 1))
        adj = rng.choice(len(ADJECTIVES), n_keys, replace=False)
        ani = rng.choice(len(ANIMALS), n_keys, replace=False)
        keys = [int(a) * len(ANIMALS) + int(b) for a, b in zip(adj, ani)]
        vals = rng.integers(0, VALUE_HI - VALUE_LO + 1, n_keys)
        needles = [np.concatenate([self.name_ids[k], self.value_ids[v], self.nl]) for k, v in zip(keys, vals)]
        while n_keys > 1 and 2 * sum(len(x) for x in needles) > T // 2:  # short rows: fewer keys
            n_keys -= 1
            needles, keys, vals = needles[:n_keys], keys[:n_keys], vals[:n_keys]
        n_q = int(rng.integers(1, n_keys + 1))
        asked = rng.permutation(n_keys)[:n_q]
        q_pieces, q_w = [], []
        for j, qi in enumerate(asked):
            name, val = self.name_ids[keys[qi]], self.value_ids[vals[qi]]
            q_pieces += [name, val]
            q_w += [np.zeros(len(name), np.float32), np.full(len(val), self.answer_weight, np.float32)]
            if j + 1 < n_q:
                q_pieces.append(self.nl)
                q_w.append(np.ones(1, np.float32))
        extra = sum(len(x) for x in needles) + sum(len(x) for x in q_pieces)
        c = T - extra  # context tokens
        span = min(span, c)
        lo = np.searchsorted(self.line_pos, c)
        for _try in range(8):
            # window [s, e] of the stream whose last token ends a line
            e = int(self.line_pos[int(rng.integers(lo, len(self.line_pos)))])
            s = e - c + 1
            a = np.searchsorted(self.line_pos, s + c - span)
            b = np.searchsorted(self.line_pos, e)  # exclude e itself: the queries follow it
            cand = self.line_pos[a:b] - s
            if len(cand) >= n_keys:
                break
        else:
            return self.plain_row(rng, T)  # no window with enough line starts (tiny corpora)
        ctx = self.stream[s : e + 1].astype(np.int64)
        where = np.sort(rng.choice(cand, n_keys, replace=False))
        pieces, weights, prev = [], [], 0
        for pos, nd in zip(where, needles):
            pieces += [ctx[prev : pos + 1], nd]
            weights += [np.ones(pos + 1 - prev, np.float32), np.zeros(len(nd), np.float32)]
            prev = pos + 1
        pieces.append(ctx[prev:])
        weights.append(np.ones(c - prev, np.float32))
        ids = np.concatenate(pieces + q_pieces)
        w = np.concatenate(weights + q_w)
        assert len(ids) == T, (len(ids), T)
        return ids, w

    def batch(self, rng: np.random.Generator, B: int, T: int, p_retrieval: float, span: tuple[int, int]):
        """``ids int64[B, T]``, ``weights float32[B, T]``."""
        ids = np.empty((B, T), dtype=np.int64)
        w = np.empty((B, T), dtype=np.float32)
        for i in range(B):
            if rng.random() < p_retrieval:
                sp = int(rng.integers(span[0], min(span[1], T) + 1))
                ids[i], w[i] = self.retrieval_row(rng, T, sp)
            else:
                ids[i], w[i] = self.plain_row(rng, T)
        return ids, w
