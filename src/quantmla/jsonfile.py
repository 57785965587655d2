"""Result files as strict JSON that reads well and stays small.

``dumps(doc)`` indents objects and lists of objects one space a level, as ``json.dumps(doc, indent=1)`` does, but
writes a list that holds only numbers, strings, booleans and nulls on one line (a row of per-sample results, a
curve); ``json.loads`` gives back the same document. ``strict(x)`` turns NaN and infinities into null, which strict
JSON readers require. ``write(path, doc)`` writes ``dumps(strict(doc))`` and a newline.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def strict(x):
    """``x`` with every non-finite float replaced by None, recursively through dicts, lists and tuples."""
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _key(k) -> str:
    """A dict key as ``json.dumps`` writes it: strings as they are, numbers, booleans and None by their JSON
    spelling; any other key is refused."""
    if isinstance(k, str):
        return k
    if k is None or isinstance(k, (bool, int, float)):
        return json.dumps(k)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")


def _flat(x) -> bool:
    return isinstance(x, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in x)


def dumps(doc, indent: int = 1, *, default=None, _level: int = 0) -> str:
    """``doc`` as indented JSON with lists of scalars on one line; ``default`` as in ``json.dumps``."""
    if _flat(doc) or not isinstance(doc, (dict, list, tuple)) or not doc:
        return json.dumps(doc, default=default)
    pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
    sub = lambda v: dumps(v, indent, default=default, _level=_level + 1)  # noqa: E731
    if isinstance(doc, dict):
        body = [f"{inner}{json.dumps(_key(k))}: {sub(v)}" for k, v in doc.items()]
        return "{\n" + ",\n".join(body) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + sub(v) for v in doc) + "\n" + pad + "]"


def write(path: str | Path, doc, *, default=None) -> None:
    """Write ``dumps(strict(doc))`` and a newline to ``path``."""
    Path(path).write_text(dumps(strict(doc), default=default) + "\n")
