"""How many padding tokens do a serve-bench run's prefill graphs compute, for a given largest prefill graph?

    PYTHONPATH=src:lab python3 -m quantmla_lab.bench.serving.prefill_padding lab/results/serving/long_1.26gib_h200.json \
        --graph-max 16384 4096 --out lab/results/serving/prefill_padding_long_1.26gib.json

Replays each run of the result through the engine's own scheduler (``serving.scheduler.Scheduler``: same job, pages,
token budget and watermark; no model), and counts, for every step that prefills, the whole-prompt chunks that a
prefill graph would take (``start == 0`` and at most the largest graph's tokens: ``Engine._prefill_graphs_step``'s
rule) and the tokens their buckets (``serving.graphs.graph_buckets_for_prefill``, as the engine's) add. The engine
also caps the buckets at a sequence's page capacity, which no prompt of the job exceeds. The replay gives the measured step and decode-step
counts exactly; the script checks that.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from quantmla.serving.graphs import graph_buckets_for_prefill
from quantmla_lab.bench.common import parse_fresh, save
from quantmla_lab.bench.serving.projection import job_scheduler, plans
from quantmla_lab.bench.serving.throughput import BenchSettings, make_job
from quantmla_lab.bench.serving.throughput_report import representative_runs


def padding(job, pages: int, s: BenchSettings, graph_max: int, graph_min: int = 128) -> dict:
    """One run replayed: steps, decode steps, graph chunks, their tokens and the padding their buckets add."""
    buckets, largest = graph_buckets_for_prefill(graph_min, s.max_num_batched_tokens, graph_max)
    sched = job_scheduler(job, pages, s)
    chunks = tokens = pad = eager_tokens = 0
    for plan in plans(sched):
        if plan.is_decode:
            continue
        for it in plan.items:
            if it.n > 1 and it.start == 0 and it.n <= largest:
                chunks, tokens = chunks + 1, tokens + it.n
                pad += next(b for b in buckets if b >= it.n) - it.n
            elif it.n > 1:
                eager_tokens += it.n
    st = sched.stats
    return {"steps": st.steps, "decode_steps": st.decode_steps, "graph_chunks": chunks, "graph_tokens": tokens,
            "padding_tokens": pad, "eager_chunk_tokens": eager_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--graph-max", type=int, nargs="+", default=[16384, 4096])
    ap.add_argument("--out", required=True)
    a = parse_fresh(ap)
    res = json.load(open(a.result))
    st = res["settings"]
    s = BenchSettings(**{k: st[k] for k in ("requests", "prompt_min", "prompt_max", "output_min", "output_max", "seed",
                                             "page_size", "max_num_seqs", "max_num_batched_tokens", "watermark")})
    job = make_job(s, vocab=100)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python3", "-m", "quantmla_lab.bench.serving.prefill_padding"] + sys.argv[1:]),
           "source": a.result, "source_commit": res.get("commit"), "runs": []}
    for run in representative_runs(res["runs"]):  # a result with repeats: each method's median run
        for g in a.graph_max:
            r = padding(job, run["pages"], s, g)
            if (r["steps"], r["decode_steps"]) != (run["steps"], run["decode_steps"]):
                sys.exit(f"{run['method']} at {run['budget_gib']} GiB: the replay gives {r['steps']} steps, "
                         f"{r['decode_steps']} decode steps; the run measured {run['steps']}, {run['decode_steps']}")
            out["runs"].append({"method": run["method"], "budget_gib": run["budget_gib"], "graph_max": g,
                                "mixed_s": run["mixed_s"], **r})
            print(f"{run['method']:>10} {run['budget_gib']:g} GiB, graphs up to {g:5d} tokens: {r['graph_chunks']:3d} "
                  f"graph chunks of {r['graph_tokens']} tokens + {r['padding_tokens']} padding; "
                  f"{r['eager_chunk_tokens']} tokens in eager chunks")
    save(out, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
