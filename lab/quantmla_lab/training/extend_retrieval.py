"""Extend a held-out set's retrieval samples to N per length, without the training host.

The held-out set's first samples were drawn from its retrieval pool (held-out packages' code, built
where the reference models were trained). The pool itself is not kept, so the extra samples come from
the held-out code documents the set does keep (`code.jsonl`: the same held-out packages, never a
training file's content), with their own seed; the existing samples stay as they are, first.

    python -m quantmla_lab.training.extend_retrieval --heldout models/heldout --tokenizer models/qmla-ref-deepseek-v2 --n 200

The manifest records what was added: ``retrieval.n``, and ``retrieval.extended`` (from how many, the
pool, the seed). Every model sharing the set's tokenizer reads the same samples.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantmla.corpus.datasets import load_retrieval, load_texts, write_jsonl

KINDS = (("retrieval", 4), ("passkey", 1))


def extend(heldout: Path, tokenizer, n: int, seed: int = 1, log=print) -> dict:
    """Bring every ``<kind>_<L>.jsonl.xz`` of ``heldout`` to ``n`` samples; returns {file: samples added}."""
    from quantmla_lab.training.tasks import make_eval_samples

    manifest_path = heldout / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    lengths = manifest["retrieval"]["lengths"]
    pool = load_texts("code", heldout)
    added = {}
    for L in lengths:
        for kind, n_keys in KINDS:
            have = load_retrieval(L, heldout, kind=kind)
            if len(have) >= n:
                continue
            new = make_eval_samples(tokenizer, pool, L, n - len(have), seed=seed, n_keys=n_keys, tag=f"{kind}-extend")
            seen = {s["prompt"] for s in have}
            for i, s in enumerate(new):
                if s["prompt"] in seen:
                    raise RuntimeError(f"{kind} {L}: an extra sample repeats an existing prompt; pick another --seed")
                s["id"] = f"{kind[0]}{L}-{len(have) + i:04d}"
            write_jsonl(heldout / f"{kind}_{L}.jsonl.xz", have + new)
            added[f"{kind}_{L}"] = len(new)
            log(f"{kind} {L}: {len(have)} + {len(new)} samples")
    if added:
        ext = manifest["retrieval"].get("extended") or []
        ext.append({"from": manifest["retrieval"]["n"], "to": n, "pool": "code.jsonl (the set's held-out code)",
                    "seed": seed, "tag": "<kind>-extend"})
        manifest["retrieval"].update(n=n, extended=ext)
        manifest_path.write_text(json.dumps(manifest, indent=1))
    return added


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heldout", default="models/heldout", help="held-out set directory (with manifest.json)")
    ap.add_argument("--tokenizer", required=True, help="a model directory holding the set's tokenizer")
    ap.add_argument("--n", type=int, required=True, help="samples per length and kind")
    ap.add_argument("--seed", type=int, default=1, help="seed of the extra samples")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    heldout = Path(a.heldout)
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    want = json.loads((heldout / "manifest.json").read_text()).get("tokenizer_sha256")
    from quantmla_lab.training.tokenizer import file_sha256

    have = file_sha256(Path(a.tokenizer) / "tokenizer.json")
    if want and have != want:
        raise SystemExit(f"{a.tokenizer}/tokenizer.json is not the held-out set's tokenizer (sha256 {have[:12]} "
                         f"against {want[:12]}): give a model directory trained with this set")
    extend(heldout, tok, a.n, a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
