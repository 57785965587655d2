"""The repository as a whole: the import graph of the library and the lab has no cycles, the library
never imports the lab, every path that the README, the docs and the code name exists, and test modules
leave the process environment alone at import."""

import argparse
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "quantmla"  # the library
LAB = ROOT / "lab" / "quantmla_lab"  # the lab: reference-model training and benchmarks


def _module_name(path: Path) -> str:
    pkg = LAB if path.is_relative_to(LAB) else PKG
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, deferred: bool = False):
    """Import statements that run when the module is imported: top level, inside if/try/with blocks
    and class bodies, not under ``if TYPE_CHECKING``. With `deferred`, also those inside functions
    (run when the function is called)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            todo += node.orelse if _is_type_checking(node.test) else node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, (ast.With, ast.For, ast.While, ast.ClassDef)) or (
                deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            todo += node.body


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """quantmla / quantmla_lab module -> the modules of both that importing it runs: each module it
    imports and, since importing a.b.c first runs package a.b, each package above it that is not above
    the importer. With `deferred`, the imports inside its functions count too."""
    modules = {_module_name(p): p for pkg in (PKG, LAB) for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        own = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path)), deferred):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    up = own.split(".")[: len(own.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if not t.startswith("quantmla"):
                    continue
                parts = t.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in modules and dep != name and not (name + ".").startswith(dep + "."):
                        deps.add(dep)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_import_graph_has_no_cycles():
    graph = import_graph()
    assert "quantmla.serving.engine" in graph and "quantmla.cache.config" in graph["quantmla.serving.engine"]
    assert "quantmla.serving.engine" in graph["quantmla_lab.bench.serving.throughput"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Two modules that import each other inside functions: still one job split in two. The calibration
# command and its streamed variant do; the entry goes when they no longer do.
KNOWN_DEFERRED_CYCLES: set[frozenset] = set()


def test_no_import_cycles_through_function_level_imports():
    graph = import_graph(deferred=True)
    cycles = []
    while (c := find_cycle(graph)) is not None:
        cycles.append(c)
        graph[c[-2]].discard(c[-1])  # break it, look for the next
    found = {frozenset(c) for c in cycles}
    new = [" -> ".join(c) for c in cycles if frozenset(c) not in KNOWN_DEFERRED_CYCLES]
    assert not new, f"import cycles through function-level imports: {new}"
    gone = [sorted(k) for k in KNOWN_DEFERRED_CYCLES - found]
    assert not gone, f"these cycles are gone: remove them from KNOWN_DEFERRED_CYCLES: {gone}"


def test_the_library_imports_nothing_from_the_lab():
    """src/quantmla never imports quantmla_lab, at import time or inside a function: the lab depends on
    the library, not the other way round (the CLI names lab commands by module and imports them only
    when run: tests below)."""
    graph = import_graph(deferred=True)
    assert any(d.startswith("quantmla.") for d in graph["quantmla_lab.training.train"])  # the graph sees both
    wrong = {m: sorted(d for d in deps if d.split(".")[0] == "quantmla_lab")
             for m, deps in graph.items() if m.split(".")[0] == "quantmla"}
    assert not {m: d for m, d in wrong.items() if d}, f"library modules importing the lab: {wrong}"


def test_cycle_finder_sees_package_and_function_level_rules():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\ntry:\n    import c\nexcept ImportError:\n    import d\n"
                     "def f():\n    import e\nclass K:\n    import g\n")
    assert sorted(a.names[0].name for a in _imports(tree)) == ["a", "c", "d", "g"]
    assert sorted(a.names[0].name for a in _imports(tree, deferred=True)) == ["a", "c", "d", "e", "g"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == ["x", "y", "z", "x"]
    assert find_cycle({"x": {"y"}, "y": set(), "z": {"y"}}) is None


# -- every path the README, the docs and the code name exists -----------------------------------------
TOP = ("src", "lab", "docs", "bench", "models", "tests", "results", "scripts")  # bench/: none (old paths show up)
PATH_RE = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./*{},-]*[\w*}])")


def _named_paths(text: str, files_only: bool = False):
    """Repository paths in `text`: words that start with a top-level folder (src/, docs/, bench/, ...),
    in backticks, links or plain prose; ``{a,b}`` alternatives and ``*`` globs are expanded. Left out:
    placeholders (an all-capitals part such as NAME or OUT) and, with `files_only` (code, where folders
    named are mostly outputs a command creates), words without a file extension."""
    for m in PATH_RE.finditer(text):
        p = m.group(1).rstrip(".,")
        if any(re.fullmatch(r"[A-Z][A-Z_]+(\.\w+)?", part) for part in p.split("/")):
            continue
        if files_only and not re.search(r"\.[a-z]\w*$", p):
            continue
        alts = re.match(r"(.*)\{([^}]*)\}(.*)", p)
        yield from ([alts.group(1) + a + alts.group(3) for a in alts.group(2).split(",")] if alts else [p])


def _exists(p: str) -> bool:
    return any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()


def _sources():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").rglob("*.md"))
    yield from sorted((ROOT / "lab").rglob("*.md"))
    for folder in ("src", "lab", "scripts", "tests"):
        for ext in ("*.py", "*.sh"):
            yield from sorted(p for p in (ROOT / folder).rglob(ext) if p != Path(__file__).resolve())
    yield ROOT / "Makefile"


def test_every_named_path_exists():
    missing = []
    for src in _sources():
        if not src.exists():
            continue
        text = src.read_text()
        for p in _named_paths(text, files_only=src.suffix != ".md"):
            if not _exists(p):
                missing.append(f"{src.relative_to(ROOT)}: {p}")
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def test_markdown_links_resolve():
    """Relative links and images in the README and the docs point at files of the repository."""
    broken = []
    for src in _sources():
        if src.suffix != ".md" or not src.exists():
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", src.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (src.parent / target).resolve().is_relative_to(ROOT) or not (src.parent / target).exists():
                broken.append(f"{src.relative_to(ROOT)}: {target}")
    assert not broken, f"links that do not resolve in the repository: {broken}"


def test_nothing_points_outside_the_repository():
    outside = []
    for src in _sources():
        if src.exists() and re.search(r"\.\./shared|/work/|DESIGN\.md", src.read_text()):
            outside.append(str(src.relative_to(ROOT)))
    assert not outside, f"files that point outside the repository: {outside}"


def test_named_path_finder():
    text = "see `docs/design.md`, bench/results/{a,b}.json and [x](src/quantmla/cli.py). Not mysrc/x, bench/NAME.py."
    assert list(_named_paths(text)) == ["docs/design.md", "bench/results/a.json", "bench/results/b.json",
                                        "src/quantmla/cli.py"]
    assert list(_named_paths("writes results/quick and bench/x.json", files_only=True)) == ["bench/x.json"]


# -- test modules leave the environment alone at import ------------------------------------------------
def test_test_modules_leave_the_environment_alone_at_import():
    """Only conftest.py sets the process environment (TRITON_INTERPRET, ...) at import: a test module
    that did would change the mode of every test collected after it. Per test: monkeypatch.setenv."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "conftest.py":
            continue
        tree = ast.parse(path.read_text())
        top = list(_module_level_statements(tree))
        for node in top:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and sub.attr in ("setdefault", "update", "putenv", "pop") and \
                        "environ" in ast.unparse(sub.value) + sub.attr or (
                        isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store) and "environ" in ast.unparse(sub.value)):
                    offenders.append(f"{path.relative_to(ROOT)}:{sub.lineno}")
    assert not offenders, f"module-level environment changes: {offenders}"


def _module_level_statements(tree: ast.Module):
    """Statements run at import: everything outside function and class bodies."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo += [s for f in ("body", "orelse", "finalbody") for s in getattr(node, f, [])]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
            continue
        yield node


def test_environment_check_sees_import_time_changes():
    tree = ast.parse("import os\nif x:\n    os.environ.setdefault('A', '1')\nos.environ['B'] = '2'\n"
                     "def f():\n    os.environ['C'] = '3'\n")
    found = [n for n in _module_level_statements(tree) if "environ" in ast.unparse(n)]
    assert len(found) == 2


# -- no fallbacks for modules that are part of the package ---------------------------------------------
def test_a_subcommand_module_that_cannot_be_imported_is_an_error(monkeypatch):
    """Every subcommand ships with the package, a lab command with the lab: an import failure is a bug
    to see, not a subcommand reported as unavailable."""
    from quantmla import cli

    for module in ("quantmla.no_such_module", "quantmla_lab.no_such_module"):
        monkeypatch.setitem(cli.SUBCOMMANDS, "nothing", (module, "a subcommand that does not exist"))
        with pytest.raises(ModuleNotFoundError, match="no_such_module"):
            cli.build_parser()
        with pytest.raises(ModuleNotFoundError, match="no_such_module"):
            cli.main(["nothing"])


def test_the_cli_imports_only_the_command_it_runs(monkeypatch, capsys):
    from quantmla import cli

    monkeypatch.setitem(cli.SUBCOMMANDS, "nothing", ("quantmla.no_such_module", "a subcommand that does not exist"))
    assert cli.main(["bytes", "--d-c", "512", "--d-r", "64"]) == 0
    assert "INT4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "nothing" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train-reference", "bench-kernel", "serve-bench"])
def test_lab_commands_without_the_lab_say_where_it_lives(monkeypatch, capsys, command):
    """The lab commands keep their names in the CLI; where the lab package is not importable, running
    one (with any arguments, --help too) is a clean error that says it is a lab command and how to get it."""
    from quantmla import cli

    assert cli.is_lab_command(command) and cli.SUBCOMMANDS[command][0].startswith("quantmla_lab.")
    assert cli.lab_installed()
    monkeypatch.setattr(cli, "lab_installed", lambda: False)
    for argv in ([command], [command, "--out", "x.json", "--requests", "3"], [command, "--help"]):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        assert not out and "Traceback" not in err
        assert f"quantmla {command}: error: `quantmla {command}` is a lab command" in err
        assert "lab/" in err and "pip install -e ." in err and "PYTHONPATH=src:lab" in err
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "is a lab command" in sub.choices[command].description  # `quantmla --help` still lists it
