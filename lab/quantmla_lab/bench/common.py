"""What the benchmarks share: the header of a result record, saving it, and the short serving job.

The benchmarks run as modules, ``python3 -m quantmla_lab.bench.TOPIC.NAME`` (with the lab importable:
an install, or ``PYTHONPATH=src:lab``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from quantmla import jsonfile
from quantmla.kernels.partials import partials_setting


def record(**fields) -> dict:
    """A result's header (device, UTC date, command line, commit, the split partials' setting, torch version)
    followed by ``fields``."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    from quantmla_lab.bench.kernels.decode_speed import source_commit

    return {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python3"] + sys.argv), "commit": source_commit(), "partials": partials_setting(),
            "torch": torch.__version__, **fields}


def launch_ms(run, reps: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``run()`` (a kernel launch, or a few) over ``reps`` calls, each between two CUDA events
    and synchronized, after ``warmup`` calls."""
    import statistics

    for _ in range(warmup):
        run()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def parse_fresh(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """``ap``'s arguments, ending the process if its ``--out`` file exists (a result is never overwritten)."""
    a = ap.parse_args()
    if a.out and Path(a.out).exists():
        sys.exit(f"{a.out} exists: remove it or name another --out")
    return a


def cache_row(text: str, methods: tuple[str, ...]) -> tuple[str, str, int, int]:
    """A ``--rows`` entry CONFIG:METHOD:C/R (e.g. INT4/INT4:kivi:64/32) as (config, method, content group, RoPE group),
    METHOD one of `methods`; anything else ends the process naming the form."""
    parts = text.split(":")
    if len(parts) != 3 or parts[1] not in methods or parts[2].count("/") != 1 or \
            not all(x.isdigit() for x in parts[2].split("/")):
        sys.exit(f"--rows {text}: CONFIG:METHOD:C/R with METHOD one of {methods} and C/R the groups, e.g. 64/32")
    c, r = (int(x) for x in parts[2].split("/"))
    return parts[0], parts[1], c, r


def plain(x):
    """A numpy or torch scalar (0-d) as the Python number it holds (non-finite floats as None); anything else JSON
    cannot hold is refused."""
    if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):
        v = x.item()
        if v is None or isinstance(v, (bool, int, float, str)):
            return jsonfile.strict(v)
    raise TypeError(f"a {type(x).__name__} is not JSON")


def save(res: dict, path: str | None, default=plain) -> None:
    """Write ``res`` to ``path`` as strict JSON (:func:`quantmla.jsonfile.write`; ``default`` turns what JSON cannot
    hold into what it can, as in ``json.dumps``), making its folder; nothing when path is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        jsonfile.write(path, res, default=default)


def short_job_parser(doc: str) -> argparse.ArgumentParser:
    """Arguments of the short-job scripts: a checkpoint, the job's size, its KV budget, the methods."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("model", help="a shipped checkpoint directory (models/qmla-ref-*)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--new", type=int, default=96, help="new tokens per request")
    p.add_argument("--budget-gib", type=float, default=0.002, help="KV budget (2 MiB)")
    p.add_argument("--methods", nargs="+", default=["bf16", "int4/int4"])
    return p


def short_job(model_path: str, requests: int, new: int, device: str, seed: int = 0):
    """The short `quantmla serve` job of the capture benchmarks: a shipped checkpoint in bf16 and
    ``requests`` random prompts of 30–300 tokens, ``new`` new tokens each (EOS ignored)
    -> (model, prompts, SamplingParams)."""
    from transformers import AutoModelForCausalLM

    from quantmla.serving.scheduler import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(30, 300, (requests,), generator=g).tolist()
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    return model, prompts, SamplingParams(max_new_tokens=new, ignore_eos=True)
