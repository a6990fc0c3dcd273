"""The shape of the code: imports run one way (apps -> export -> runtime -> kv_manager), and no import hides a cycle.

Every module of the package is read with `ast` (nothing is imported). An import inside a function counts like one
at the top of the module: a function-level import that exists to dodge a cycle closes that cycle here and fails.
Imports under `if TYPE_CHECKING:` are for annotations only and never run, so the one-way rule leaves them out; a
circle they close is still a circle for a reader (a module that needs the type of the module that imports it), so
the cycle checks count them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "staticlm"
LAYERS = {"kv_manager": 0, "runtime": 1, "export": 2, "apps": 3}  # a module may import its own layer and below
BASE = {f"{PACKAGE}.errors"}  # imported by every layer, imports nothing of ours


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", "build") or rel.parts[0].startswith("."):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PACKAGE, *parts])] = path
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def imports_of(module: str, *, type_only: bool = False) -> list[tuple[str, bool]]:
    """(imported module of ours, whether inside a function) for every import that runs; type_only: the imports
    under `if TYPE_CHECKING:` too."""
    tree = ast.parse(MODULES[module].read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if _is_package(module) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or \
                (not type_only and _type_checking_only(node, parents)):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name` imports pkg.name when that is a module, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        inside = _in_function(node, parents)
        found += [(t, inside) for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")]
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_import_of_ours_names_a_module_that_exists():
    missing = [(m, t) for m in MODULES for t, _ in imports_of(m) if t not in MODULES]
    assert not missing


def test_imports_run_one_way():
    """runtime and kv_manager never import export or apps; export never imports apps; nothing imports upward."""
    upward = []
    for module in MODULES:
        for target, _ in imports_of(module):
            if target in BASE:
                continue
            source_layer, target_layer = _layer(module), _layer(target)
            if source_layer is not None and (target_layer is None or target_layer > source_layer):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the one direction (apps -> export -> runtime -> kv_manager):\n" + \
        "\n".join(upward)
    for module in BASE:
        assert not imports_of(module), f"{module} is the base every layer imports: it imports nothing of ours"


def module_graph(*, type_only: bool = True) -> dict[str, set[str]]:
    """Every module's imports of ours (inside functions too; type_only: under TYPE_CHECKING too)."""
    return {m: {t for t, _ in imports_of(m, type_only=type_only) if t in MODULES and t != m} for m in MODULES}


def test_no_import_cycle_even_through_imports_inside_functions():
    cycles = _cycles(module_graph(type_only=False))
    assert not cycles, "import cycles (an import inside a function counts):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def test_no_type_only_import_circle():
    """A module that needs, for its annotations, the module that imports it: the two are one module to read."""
    cycles = _cycles(module_graph(type_only=True))
    assert not cycles, "import circles closed by imports under TYPE_CHECKING:\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def child_of(module: str, package: str) -> str:
    """What a package-level cycle inside package is counted between: its sub-package (staticlm.export.htp) or
    top-level module (staticlm.export.family) that holds module."""
    return ".".join(module.split(".")[:len(package.split(".")) + 1])


def package_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The module graph's edges between different children of package (child_of)."""
    inside = [m for m in graph if m.startswith(package + ".")]
    out: dict[str, set[str]] = {child_of(m, package): set() for m in inside}
    for module in inside:
        out[child_of(module, package)] |= {child_of(t, package) for t in graph[module]
                                           if t.startswith(package + ".")} - {child_of(module, package)}
    return out


PACKAGES = sorted(m for m in MODULES if _is_package(m))


@pytest.mark.parametrize("package", PACKAGES)
def test_sub_packages_import_each_other_one_way(package):
    """A cycle of packages hides in no single module: export/gptq reading export/htp while export/htp reads
    export/gptq is one, though no module imports itself back. Checked inside every package, the root included
    (its layers), an import inside a function or under TYPE_CHECKING counting."""
    cycles = _cycles(package_graph(module_graph(), package))
    assert not cycles, f"import cycles between {package}'s packages:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_layer_and_its_floors_are_checked():
    for layer in LAYERS:
        assert f"{PACKAGE}.{layer}" in PACKAGES
    assert {"staticlm.apps.serve", "staticlm.apps.commands", "staticlm.export.htp", "staticlm.export.cpu",
            "staticlm.runtime.generate"} <= set(PACKAGES)


def test_package_graph_finds_a_cycle_that_no_module_closes():
    modules = {"staticlm.export.a.x": {"staticlm.export.b.y"}, "staticlm.export.b.y": set(),
               "staticlm.export.b.z": {"staticlm.export.a.w", "staticlm.runtime.r"}, "staticlm.export.a.w": set(),
               "staticlm.export.c": {"staticlm.export.a.w"}, "staticlm.runtime.r": set()}
    assert not _cycles(modules)
    assert _cycles(package_graph(modules, "staticlm.export")) == [["staticlm.export.a", "staticlm.export.b"]]
    assert not _cycles(package_graph(modules, "staticlm.export.a"))


def test_a_type_only_import_closes_a_circle(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("from staticlm.b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from staticlm.a import A\n")
    monkeypatch.setitem(MODULES, "staticlm.a", tmp_path / "a.py")
    monkeypatch.setitem(MODULES, "staticlm.b", tmp_path / "b.py")
    assert not _cycles(module_graph(type_only=False))
    assert ["staticlm.a", "staticlm.b"] in _cycles(module_graph(type_only=True))


def test_the_package_lists_every_folder_that_ships():
    """pyproject names packages one by one (the root is the package): a folder left out would not install."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {m for m in MODULES if _is_package(m)}
    assert set(config["packages"]) == packages


# Decisions each made in one module: who calls the functions and classes that carry them out. A linear layer of the
# CPU target: which nodes it is and how its weights are rounded, in export/cpu/linears.py, whose node writers
# (linear_parts.py) and quantizer (quant.py) write what it says. A second caller would decide again around it (the
# way weights.py once did, calling linears.py, then quant.py, then linears.py again for one linear).
SOLE_CALLERS = {r"write_\w+_part|BlockQuantizer": f"{PACKAGE}.export.cpu.linears"}


def callers_of(pattern: str) -> dict[str, set[str]]:
    """module -> the names matching pattern that it calls (a plain name or an attribute)."""
    import re

    out: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name and re.fullmatch(pattern, name):
                    out.setdefault(module, set()).add(name)
    return out


@pytest.mark.parametrize("pattern", SOLE_CALLERS)
def test_a_decision_is_carried_out_from_one_module(pattern):
    callers = callers_of(pattern)
    assert callers, f"nothing calls {pattern}: the rule names what no longer exists"
    assert set(callers) == {SOLE_CALLERS[pattern]}, f"{pattern} called from {sorted(callers)}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of what a reader reads as prose: a module's comments and docstrings, a document whole."""
    text = path.read_text(errors="ignore")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    import io
    import tokenize

    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and \
                ast.get_docstring(node) is not None:
            first = node.body[0]
            out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return out


def test_the_files_that_comments_and_the_docs_name_exist():
    """A `name.py` (or .c, .h) in a comment, a docstring, README.md or ARCHITECTURE.md is a file of the tree: a moved
    or removed file leaves no directions to nowhere."""
    import re

    files = [p for p in ROOT.rglob("*") if p.is_file() and p.relative_to(ROOT).parts[0] not in (
        "build", ".venv", ".git", ".hypothesis", ".ruff_cache", ".pytest_cache")]
    names = {p.name for p in files}
    system = {"stddef.h", "stdint.h", "stdlib.h", "string.h", "math.h", "stdio.h", "time.h", "pthread.h",
              "immintrin.h", "arm_neon.h", "onnxruntime_c_api.h"}
    stale = []
    for path in files:
        if path.suffix not in (".py", ".md", ".c", ".h", ".sh") or path.parts[-2:] == ("tests", "test_architecture.py"):
            continue
        for number, line in _prose(path):
            if line.lstrip().startswith("#include <"):  # a system header
                continue
            for named in re.findall(r"(?<![\w.])[\w/]+\.(?:py|c|h)\b", line):
                base = named.rsplit("/", 1)[-1]
                if base not in names and base not in system:
                    stale.append(f"{path.relative_to(ROOT)}:{number}: {named}")
    assert not stale, "names of files that do not exist:\n" + "\n".join(stale)


MAX_FUNCTION_LINES = 60


def test_no_function_in_runtime_or_export_runs_past_60_lines():
    long = []
    for layer in ("runtime", "export"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = f"{path.relative_to(ROOT)}:{node.name}"
                    if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                        long.append(f"{where} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
