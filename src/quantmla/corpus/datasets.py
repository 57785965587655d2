"""The shipped held-out sets and reference models (``models/`` of the repository).

Layout (written by ``quantmla train-reference`` on the GPU machine)::

    models/heldout/code.jsonl                 {"text": ..., "source": "site/<pkg>/<path>"} per line
    models/heldout/prose.jsonl                docstrings / docs / package descriptions
    models/heldout/retrieval_<N>.jsonl.xz     retrieval samples of about N tokens (4 keys)
    models/heldout/passkey_<N>.jsonl.xz       the same with a single key line
    models/heldout/manifest.json              how they were selected (packages, hashes)
    models/<model-name>/                      from_pretrained directories with card.json

Every file comes from packages that no reference model was trained on. Set
``QUANTMLA_MODELS`` to use another ``models`` directory.
"""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path

REFERENCE_MODELS = (
    "qmla-ref-deepseek-v2",
    "qmla-ref-deepseek-v3",
    "qmla-ref-minicpm3",
    "qmla-ref-glm4-moe-lite",
)
DEFAULT_MODEL = "qmla-ref-deepseek-v3"
RETRIEVAL_LENGTHS = (1024, 2048, 4096)  # tokens of context of the held-out key-retrieval samples


def models_root() -> Path:
    env = os.environ.get("QUANTMLA_MODELS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "models"


def heldout_root(root: str | Path | None = None) -> Path:
    return Path(root) if root is not None else models_root() / "heldout"


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """Directory of a shipped reference model (``from_pretrained`` accepts it)."""
    p = models_root() / name
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"no reference model at {p}; run `quantmla train-reference` or check QUANTMLA_MODELS")
    return p


def _read_jsonl(path: Path) -> list[dict]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = lzma.open if path.suffix == ".xz" else open
    kw = {"preset": 9 | lzma.PRESET_EXTREME} if path.suffix == ".xz" else {}
    with opener(path, "wt", encoding="utf-8", **kw) as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def load_texts(kind: str = "code", root: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Held-out documents: ``kind`` is ``"code"`` or ``"prose"``."""
    rows = _read_jsonl(heldout_root(root) / f"{kind}.jsonl")
    return [r["text"] for r in rows[:limit]]


def load_retrieval(length: int = 4096, root: str | Path | None = None, limit: int | None = None,
                   kind: str = "retrieval") -> list[dict]:
    """Retrieval samples (``prompt``, ``answer``, ...) of about ``length`` tokens.

    ``kind="retrieval"``: 4 key lines (one asked for, 3 distractors); ``"passkey"``: one."""
    rows = _read_jsonl(heldout_root(root) / f"{kind}_{length}.jsonl.xz")
    return rows[:limit]


def retrieval_lengths(root: str | Path | None = None, kind: str = "retrieval") -> list[int]:
    """The lengths (tokens) of the shipped retrieval sets under `root`."""
    out = []
    for p in heldout_root(root).glob(f"{kind}_*.jsonl.xz"):
        n = p.name[len(kind) + 1 : -len(".jsonl.xz")]
        if n.isdigit():
            out.append(int(n))
    return sorted(out)
