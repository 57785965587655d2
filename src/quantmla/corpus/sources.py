"""The text corpus present on every machine without network: the Python standard library and the
installed packages (``site-packages``): source files (``*.py``) and documentation files (``*.md``,
``*.rst``, ``*.txt``), plus the package descriptions in ``*.dist-info/METADATA``.

A file is named ``<group>/<relpath>`` where ``group`` is ``stdlib`` or ``site``; its *package* is the
first path component (``numpy/...`` -> ``numpy``, ``six.py`` -> ``six``). Every choice made from the
corpus is a function of these relative names and of contents, never of the absolute location, the
walk order or a clock. The default calibration text (:func:`quantmla.corpus.calibration_text.calibration_texts`)
is read from it, as the reference models' training text was.
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path

CODE_SUFFIXES = (".py",)
DOC_SUFFIXES = (".md", ".rst", ".txt")
# Directories never walked: caches, nested interpreters' package dirs inside the stdlib,
# and this project itself (the library and its lab: nothing trains on their own sources).
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git", "node_modules", "quantmla", "quantmla_lab"}
MIN_FILE_BYTES = 200
MAX_FILE_BYTES = 400_000


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
    if first.endswith((".dist-info", ".egg-info")):
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


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
