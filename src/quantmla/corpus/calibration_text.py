"""The default calibration text: Python standard-library sources (training material of the reference models),
never from a held-out package, never a held-out document; deterministic order."""

from __future__ import annotations

import hashlib
import json
import sysconfig

from quantmla.corpus import datasets as DS
from quantmla.corpus import sources as corpus
from quantmla.errors import QuantMLAError


def calibration_texts(max_bytes: int = 400_000, heldout_root: str | None = None, seed: str = "quantmla-calib") -> list[str]:
    """Documents of at least `max_bytes` in all (whole files), from the standard library of the running Python,
    leaving out the packages and documents of the held-out set at `heldout_root` (default: the shipped one, where
    there is one; its manifest.json names whole packages to leave out, where it has one); their order is fixed by
    `seed`. A `heldout_root` given without its code.jsonl is refused: no held-out document could be left out."""
    held: set[str] = set()
    held_docs: set[str] = set()
    root = DS.heldout_root(heldout_root)
    if heldout_root is not None and not (root / "code.jsonl").exists():
        raise QuantMLAError(f"no code.jsonl under the held-out set {root}: the calibration text leaves the held-out "
                            "documents out; give the directory that holds them")
    man = root / "manifest.json"
    if man.exists():
        held = set(json.loads(man.read_text()).get("heldout_packages", []))
    if (root / "code.jsonl").exists():
        held_docs = {corpus.content_hash(t) for t in DS.load_texts("code", root)}
    files = [f for f in corpus.discover([("stdlib", sysconfig.get_paths()["stdlib"])])
             if f.kind == "code" and f"{f.group}/{f.package}" not in held and not f.package.startswith("test")]
    files.sort(key=lambda f: hashlib.sha256(f"{seed}:{f.name}".encode()).hexdigest())
    out, total = [], 0
    for f in files:
        t = corpus.read_text(f)
        if t is None or corpus.content_hash(t) in held_docs:
            continue
        out.append(t)
        total += len(t.encode())
        if total >= max_bytes:
            break
    if not out:
        raise QuantMLAError("no calibration text found (the Python standard library sources are missing)")
    return out
