"""What a serve-bench job would take at other chunk budgets (``--max-batched-tokens``): the engine's own scheduler
replayed on the job, each step priced from a measured run.

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.chunk_model \
        --job lab/results/serving/long_1.26gib_warmup_h200.json --methods fp8 int4/int4 --chunks 4096 8192 16384 \
        --out lab/results/serving/chunk_model_long_1.26gib.json

A model on measured figures, not a measurement. The job (its prompt and output lengths, from the run's settings and
seed) goes through ``serving.scheduler.Scheduler`` with the run's pages, page size, watermark and sequence cap, so
the steps, their chunks and the decode rows riding in them are the engine's. A step with no prompt tokens costs the
run's median decode step at its batch (``step_log.decode_by_batch``; a line through those medians for batches the
run did not have). A prefilling step costs max(host, GPU): host the run's median launch time of prefilling steps
with decode rows (a floor for every prefilling step), GPU = k x (a prompt token's dense, elementwise and append time
+ a causal (query, key) pair's attention time + a context token's ``kv_b_proj`` time). Those three come from the
prefill profile of the ``long`` shape (``--profile``, ``step_profile --phase prefill``: 4 prompts of 20480 tokens
in 16384-token chunks), whose steps the same scheduler replays to count their tokens, pairs and context tokens; the
context's share of the dense time is its share of the dense FLOPs. k makes the run's own chunk budget reproduce its
measured prefilling seconds, so the model is exact there and says how the rest moves; a run whose prefilling steps
the host floors alone account for leaves k undetermined and is refused.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from quantmla.serving.scheduler import Request, SamplingParams, Scheduler, Sequence
from quantmla_lab.bench.common import parse_fresh, record, save

PROFILE = "lab/results/prefill/rates_long_h200.json"


def job_lengths(settings: dict) -> list[tuple[int, int]]:
    """(prompt, output) lengths of serve-bench's job for these settings (``throughput.make_job``'s draws)."""
    rng = np.random.default_rng(settings["seed"])
    n = settings["requests"]
    p = rng.integers(settings["prompt_min"], settings["prompt_max"] + 1, n)
    o = rng.integers(settings["output_min"], settings["output_max"] + 1, n)
    return [(int(a), int(b)) for a, b in zip(p, o)]


def replay(lengths, pages: int, page_size: int, chunk: int, max_seqs: int, watermark: float,
           stats: dict | None = None) -> list[dict]:
    """The scheduler's steps for the job: per step its prompt tokens, causal pairs, context tokens read back and
    decode rows (items of one token, as the engine takes them). `stats`, where given, receives the scheduler's
    counters (``SchedulerStats``: preemptions, recomputed tokens, peak running sequences). A job with a request that
    `pages` can never hold is refused."""
    sched = Scheduler(pages, page_size, max_seqs, chunk, watermark)
    for i, (p, o) in enumerate(lengths):
        sched.add(Sequence(Request(i, [3] * p, SamplingParams(max_new_tokens=o, ignore_eos=True)), i, set()))
    if sched.stats.failed:
        raise ValueError(f"{sched.stats.failed} of the job's requests can never fit {pages} pages of {page_size} "
                         f"tokens: {sched.finished[0].error}")
    steps = []
    while sched.has_unfinished():
        plan = sched.schedule()
        if not plan.items:
            raise RuntimeError("the scheduler planned an empty step with requests unfinished")
        tokens = pairs = context = rows = 0
        for it in plan.items:
            if it.n == 1:
                rows += 1
                continue
            tokens += it.n
            pairs += it.n * it.start + it.n * (it.n + 1) // 2
            context += it.start + it.n
        steps.append({"tokens": tokens, "pairs": pairs, "context": context, "rows": rows})
        sched.commit(plan, [5 if it.sample else None for it in plan.items])
    if stats is not None:
        stats.update(sched.stats.to_dict())
    return steps


def decode_cost(by_batch: dict) -> callable:
    """Seconds of a decode step of b rows: the run's median at b, else a line through the medians."""
    b = np.array([int(k) for k in by_batch], float)
    ms = np.array([v["total_ms_median"] for v in by_batch.values()])
    slope, icpt = np.polyfit(b, ms, 1) if len(b) > 1 else (0.0, float(ms[0]))
    med = {int(k): v["total_ms_median"] for k, v in by_batch.items()}
    return lambda rows: 1e-3 * med.get(rows, icpt + slope * rows)


def step_costs(profile: dict, method: str, model: dict) -> dict:
    """GPU seconds a prompt token, a causal pair and a context token, from the prefill profile's parts for `method`
    (else its BF16 run) over the profile's own steps, replayed; `model`: the serve-bench run's geometry."""
    prof = profile["methods"].get(method) or profile["methods"]["bf16"]
    parts, flops = prof["parts"], prof["prefill"]
    steps = replay([(profile["prompt"], 1)] * profile["batch"], 1 << 20, 64, profile["max_num_batched_tokens"], 256,
                   0.0)[: profile["steps"]]
    mean = {k: float(np.mean([st[k] for st in steps])) for k in ("tokens", "pairs", "context")}
    layers, heads = model["layers"], model["heads"]
    ctx_flop = 2 * model["d_c"] * heads * (model["d_nope"] + model["d_v"]) * layers * mean["context"]
    dense_s = 1e-6 * parts["projections and MLP"]["us_per_step"]
    ctx_s = dense_s * ctx_flop / (1e12 * flops["dense_TFLOP_per_step"])
    token_s = dense_s - ctx_s + 1e-6 * (parts["other"]["us_per_step"] + parts["cache append"]["us_per_step"])
    return {"token_s": token_s / mean["tokens"], "pair_s": 1e-6 * parts["attention"]["us_per_step"] / mean["pairs"],
            "context_s": ctx_s / mean["context"], "profile_steps": steps}


def prefill_gpu_s(step: dict, c: dict) -> float:
    return c["token_s"] * step["tokens"] + c["pair_s"] * step["pairs"] + c["context_s"] * step["context"]


class Prices:
    """A method's step prices, fitted to its measured run (``run``: one serve-bench run with a step log): a decode
    step of b rows at the run's median for b (:func:`decode_cost`), a prefilling step at max(host, k x its GPU cost)
    with host the run's median launch time of prefilling steps with decode rows and k the factor that makes the run's
    own steps (replayed at its own budgets) cost its measured prefilling seconds."""

    def __init__(self, run: dict, settings: dict, costs: dict):
        pre = run["step_log"]["prefill_steps"]
        launches = [s["launch_ms"] for s in pre if s["decode_rows"] > 0] or [s["launch_ms"] for s in pre]
        if not launches:
            raise ValueError(f"{run['method']}: the run's step log has no prefilling step")
        self.host, self.costs = 1e-3 * float(np.median(launches)), costs
        self.dec = decode_cost(run["step_log"]["decode_by_batch"])
        self.measured_batches = max(int(b) for b in run["step_log"]["decode_by_batch"])
        self.own = replay(job_lengths(settings), run["pages"], settings["page_size"], settings["max_num_batched_tokens"],
                          settings["max_num_seqs"], settings["watermark"])
        lo, hi = 1e-3, 1e4  # k: the run's own chunk budget gives its measured prefilling seconds
        for _ in range(80):
            self.k = (lo * hi) ** 0.5
            lo, hi = (self.k, hi) if self.price(self.own)[0] < run["mixed_s"] else (lo, self.k)
        floor = self.price(self.own, 0.0)[0]
        if floor >= 0.98 * run["mixed_s"] or abs(self.price(self.own)[0] - run["mixed_s"]) > 0.01 * run["mixed_s"]:
            raise ValueError(f"{run['method']}: no GPU factor is determined by the run's {run['mixed_s']:.2f} "
                             f"prefilling seconds (its host floors alone give {floor:.2f})")

    def price(self, steps: list[dict], k: float | None = None) -> tuple[float, float]:
        """(prefilling seconds, decode seconds) of replayed steps."""
        k = self.k if k is None else k
        mixed = sum(max(self.host, k * prefill_gpu_s(s, self.costs)) for s in steps if s["tokens"])
        decode = sum(self.dec(s["rows"]) for s in steps if not s["tokens"])
        return mixed, decode


def model(run: dict, settings: dict, chunks: list[int], costs: dict) -> dict:
    """One method's run -> its modelled wall, prefilling and decode seconds at each chunk budget; `costs`:
    :func:`step_costs`."""
    pr = Prices(run, settings, costs)
    lengths = job_lengths(settings)
    args = (run["pages"], settings["page_size"])
    rest = dict(max_seqs=settings["max_num_seqs"], watermark=settings["watermark"])
    out = {"k": pr.k, "host_floor_ms": 1e3 * pr.host, "measured": {"wall_s": run["wall_s"], "mixed_s": run["mixed_s"],
                                "decode_s": run["graph_decode_s"] + run["eager_decode_s"]}, "chunks": {}}
    for c in chunks:
        steps = pr.own if c == settings["max_num_batched_tokens"] else replay(lengths, *args, c, **rest)
        mixed, decode = pr.price(steps)
        out["chunks"][str(c)] = {"prefilling_steps": sum(1 for s in steps if s["tokens"]),
                                 "decode_steps": sum(1 for s in steps if not s["tokens"]),
                                 "rows_riding": sum(s["rows"] for s in steps if s["tokens"]),
                                 "mixed_s": round(mixed, 3), "decode_s": round(decode, 3),
                                 "wall_s": round(mixed + decode, 3)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="lab/results/serving/long_1.26gib_warmup_h200.json",
                   help="a serve-bench result with step logs (one budget)")
    p.add_argument("--methods", nargs="+", default=["fp8", "int4/int4"])
    p.add_argument("--chunks", nargs="+", type=int, default=[4096, 8192, 16384])
    p.add_argument("--profile", default=PROFILE, help="a prefill profile (step_profile --phase prefill)")
    p.add_argument("--out", default=None)
    a = parse_fresh(p) if argv is None else p.parse_args(argv)
    with open(a.job) as f:
        res = json.load(f)
    runs = {r["method"]: r for r in res["runs"] if r["method"] in a.methods and "step_log" in r}
    missing = [m for m in a.methods if m not in runs]
    if missing:
        raise SystemExit(f"{a.job} has no run with a step log for {', '.join(missing)}; it has "
                         f"{', '.join(r['method'] for r in res['runs'])}")
    with open(a.profile) as f:
        profile = json.load(f)
    costs = {m: step_costs(profile, m, res["model"]) for m in runs}
    out = record(source=a.job, source_commit=res.get("commit"), profile=a.profile, profile_commit=profile.get("commit"),
                 note="a model on measured figures, not a measurement",
                 costs={m: {k: v for k, v in c.items()} for m, c in costs.items()},
                 methods={m: model(r, res["settings"], a.chunks, costs[m]) for m, r in runs.items()})
    for c in a.chunks:
        line = "  ".join(f"{m} {v['chunks'][str(c)]['wall_s']:.2f} s (mixed {v['chunks'][str(c)]['mixed_s']:.2f}, "
                         f"riding rows {v['chunks'][str(c)]['rows_riding']})" for m, v in out["methods"].items())
        print(f"chunks of {c:>6}: {line}")
    if len(a.methods) == 2:
        m0, m1 = a.methods
        out["ratio"] = {str(c): round(out["methods"][m0]["chunks"][str(c)]["wall_s"]
                                      / out["methods"][m1]["chunks"][str(c)]["wall_s"], 4) for c in a.chunks}
        print(f"{m1} over {m0} (wall ratio, modelled): {out['ratio']}")
    save(out, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
