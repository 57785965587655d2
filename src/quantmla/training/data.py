"""Corpus discovery and deterministic splits for the reference models.

The corpus is real text that is present on every machine without network: the Python
standard library and the installed packages (``site-packages``): source files (``*.py``)
and documentation files (``*.md``, ``*.rst``, ``*.txt``), plus the package descriptions in
``*.dist-info/METADATA`` (held-out prose only).

Determinism. Every choice is a function of *relative* paths and contents, never of the
absolute location, the walk order or a clock:

- a file is named ``<group>/<relpath>`` where ``group`` is ``stdlib`` or ``site``;
- its *package* is the first path component (``numpy/...`` -> ``numpy``, ``six.py`` -> ``six``);
- a package is held out when ``sha256("<group>/<package>")`` falls under the held-out
  fraction (only packages of a moderate size are candidates, so that one huge package
  never removes a large share of the training text);
- files are ordered by ``sha256`` of their name, and identical contents are kept once;
- held-out files whose content also occurs among the training files are dropped.

Nothing from a held-out package is ever trained on (code, docs or docstrings).
"""

from __future__ import annotations

import ast
import hashlib
import os
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

CODE_SUFFIXES = (".py",)
DOC_SUFFIXES = (".md", ".rst", ".txt")
# Directories never walked: caches, nested interpreters' package dirs inside the stdlib,
# and this project itself (it must not train on its own sources).
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git", "node_modules", "quantmla"}
MIN_FILE_BYTES = 200
MAX_FILE_BYTES = 400_000


def _h(text: str) -> int:
    """A stable 64-bit integer hash of a string (sha256 prefix)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def default_roots() -> list[tuple[str, str]]:
    """``[(group, directory)]`` of the running interpreter: stdlib and site-packages."""
    roots: list[tuple[str, str]] = []
    seen: set[str] = set()
    candidates = [("stdlib", sysconfig.get_paths()["stdlib"])]
    site_dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    site_dirs += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    candidates += [("site", d) for d in site_dirs]
    for group, d in candidates:
        if not d or not os.path.isdir(d):
            continue
        real = os.path.realpath(d)
        if real in seen:
            continue
        seen.add(real)
        roots.append((group, d))
    return roots


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus. ``name`` (``group/relpath``) is what all hashing uses."""

    group: str
    package: str
    relpath: str
    path: str
    kind: str  # "code" | "doc" | "metadata"
    size: int

    @property
    def name(self) -> str:
        return f"{self.group}/{self.relpath}"


def _package_of(relpath: str) -> str:
    first = relpath.split("/", 1)[0]
    if first.endswith(".dist-info") or first.endswith(".egg-info"):
        # "scikit_learn-1.5.0.dist-info" -> "scikit_learn"
        return first.split("-", 1)[0].lower().replace("-", "_")
    if "/" not in relpath:
        return first.rsplit(".", 1)[0]
    return first


def discover(roots: list[tuple[str, str]] | None = None, packages: list[str] | None = None) -> list[SourceFile]:
    """All candidate files under ``roots``, sorted by name. ``packages`` restricts to those
    top-level packages (used by tests to keep things small)."""
    roots = default_roots() if roots is None else roots
    files: dict[str, SourceFile] = {}
    allow = set(packages) if packages else None
    for group, root in roots:
        root = os.path.abspath(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
            rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            in_metadata = rel_dir.split("/", 1)[0].endswith((".dist-info", ".egg-info"))
            for fn in sorted(filenames):
                relpath = rel_dir + fn
                if in_metadata:
                    if fn != "METADATA":
                        continue
                    kind = "metadata"
                elif fn.endswith(CODE_SUFFIXES):
                    kind = "code"
                elif fn.endswith(DOC_SUFFIXES):
                    kind = "doc"
                else:
                    continue
                package = _package_of(relpath)
                if allow is not None and package not in allow:
                    continue
                full = os.path.join(dirpath, fn)
                try:
                    size = os.path.getsize(full)
                except OSError:
                    continue
                if not (MIN_FILE_BYTES <= size <= MAX_FILE_BYTES) or os.path.islink(full):
                    continue
                sf = SourceFile(group, package, relpath, full, kind, size)
                files.setdefault(sf.name, sf)  # first root wins on a duplicate name
    return [files[k] for k in sorted(files)]


def read_text(sf: SourceFile) -> str | None:
    """The file as text, or None when it is not clean UTF-8 text worth training on."""
    try:
        raw = Path(sf.path).read_bytes()
    except OSError:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\x00" in text:
        return None
    text = text.replace("\r\n", "\n")
    lines = text.split("\n")
    if not lines:
        return None
    longest = max(len(s) for s in lines)
    if longest > 1000 or len(text) / max(len(lines), 1) > 120:
        return None  # minified code, data tables, generated blobs
    if sf.kind != "code":
        letters = sum(c.isalpha() for c in text[:20000])
        if letters < 0.5 * min(len(text), 20000):
            return None  # tables of numbers, word lists
    return text


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
    head, sep, body = text.partition("\n\n")
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
) -> Split:
    """Hold out whole packages by hash; everything else is training material."""
    sizes = package_sizes(files)
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
    order = lambda f: _h(f"{seed}:{f.name}")  # noqa: E731
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


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
