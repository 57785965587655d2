"""Deterministic splits of the corpus (:mod:`quantmla.corpus.sources`: the Python standard library
and the installed packages, code, docs and ``METADATA`` descriptions) for the reference models.

Determinism. Every choice is a function of *relative* paths and contents, never of the
absolute location, the walk order or a clock:

- a file is named ``<group>/<relpath>`` where ``group`` is ``stdlib`` or ``site``;
- its *package* is the first path component (``numpy/...`` -> ``numpy``, ``six.py`` -> ``six``);
- a package is held out when ``sha256("<group>/<package>")`` falls under the held-out
  fraction (only packages of a moderate size are candidates, so that one huge package
  never removes a large share of the training text);
- files are ordered by ``sha256`` of their name, and identical contents are kept once;
- held-out files whose content also occurs among the training files are dropped.

Nothing from a held-out package is ever trained on (code, docs or docstrings); ``METADATA``
descriptions are held-out prose only.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass, field

# the corpus reader, shared with the library (its default calibration text is read the same way)
from quantmla.corpus.sources import (  # noqa: F401
    CODE_SUFFIXES,
    DOC_SUFFIXES,
    MAX_FILE_BYTES,
    MIN_FILE_BYTES,
    SKIP_DIRS,
    SourceFile,
    content_hash,
    default_roots,
    discover,
    read_text,
)


def _h(text: str) -> int:
    """A stable 64-bit integer hash of a string (sha256 prefix)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def extract_docstrings(source: str, min_chars: int = 60) -> list[str]:
    """Module, class and function docstrings of a Python source (prose written by people)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= min_chars:
                out.append(doc)
    return out


def metadata_description(text: str) -> str:
    """The long description (body) of a ``METADATA`` file (headers stripped)."""
    _, sep, body = text.partition("\n\n")
    return body.strip() if sep else ""


def truncate_at_line(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars``, at a line end when there is one."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut + 1] if cut > max_chars // 2 else text[:max_chars]


@dataclass
class Split:
    """The outcome of :func:`split_corpus` (file lists are in hash order)."""

    train: list[SourceFile]
    heldout_packages: list[str]
    heldout_code: list[SourceFile]
    heldout_prose: list[SourceFile]
    stats: dict = field(default_factory=dict)


def package_sizes(files: list[SourceFile]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for f in files:
        if f.kind == "code":
            key = f"{f.group}/{f.package}"
            sizes[key] = sizes.get(key, 0) + f.size
    return sizes


def split_corpus(
    files: list[SourceFile],
    heldout_fraction: float = 0.06,
    min_package_bytes: int = 20_000,
    max_package_bytes: int = 8_000_000,
    seed: str = "quantmla-ref-v1",
    heldout_packages: list[str] | None = None,
) -> Split:
    """Hold out whole packages by hash; everything else is training material. ``heldout_packages``
    (``"<group>/<package>"`` names, e.g. a shipped held-out set's manifest) fixes the held-out
    packages instead: the hash choice depends on package sizes, which differ between machines."""
    sizes = package_sizes(files)
    if heldout_packages is not None:
        held = sorted(set(heldout_packages))
    else:
        held = sorted(
            key
            for key, size in sizes.items()
            if min_package_bytes <= size <= max_package_bytes
            and (_h(f"{seed}:{key}") % 10_000) < heldout_fraction * 10_000
        )
    held_set = set(held)
    train, hcode, hprose = [], [], []
    for f in files:
        key = f"{f.group}/{f.package}"
        if key in held_set:
            (hcode if f.kind == "code" else hprose).append(f)
            if f.kind == "code":
                hprose.append(f)  # docstrings of held-out code are held-out prose
        elif f.kind in ("code", "doc"):
            train.append(f)
    order = lambda f: _h(f"{seed}:{f.name}")
    train.sort(key=order)
    hcode.sort(key=order)
    hprose.sort(key=order)
    return Split(train, held, hcode, hprose, {"packages": len(sizes), "heldout_packages": len(held)})


def round_robin(files: list[SourceFile]) -> list[SourceFile]:
    """Interleave files by package (keeps each package's hash order), so that a capped
    selection covers many packages instead of the first big one."""
    by_pkg: dict[str, list[SourceFile]] = {}
    for f in files:
        by_pkg.setdefault(f"{f.group}/{f.package}", []).append(f)
    queues = [by_pkg[k] for k in sorted(by_pkg)]
    out: list[SourceFile] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out
