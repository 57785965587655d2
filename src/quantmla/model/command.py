"""`quantmla spec MODEL`: the MLA spec of a checkpoint directory (reads config.json only)."""

from __future__ import annotations

import json


def add_arguments(p):
    p.add_argument("model", help="checkpoint directory (with config.json)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    from quantmla.model.spec import load_spec

    spec = load_spec(args.model)
    d = spec.to_dict()
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        for k, v in d.items():
            print(f"{k:<20} {v}")
        if not spec.caches_latent:
            print("note: transformers caches expanded K/V for this family; QuantMLACache cannot attach")
    return 0
