"""The package reads in one look: the README's map names every module, imports flow one way, no function or module
is long, and notebooks only narrate and glue."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from spectie.records.chapters import _module_file, _spectie_imports

PACKAGE = Path(__file__).resolve().parents[1] / "spectie"


def _modules() -> dict[str, Path]:
    """Every module of the package, dotted below `spectie` (a subpackage by its __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] in ("__init__", "__main__"):
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def test_the_readme_maps_every_layer_and_each_layer_names_its_modules():
    """The README's package map names each layer (a folder of the package) and the modules beside cli.py; each
    layer's __init__ docstring names its modules (`name`, or `prefix*` for a family)."""
    import ast

    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme[readme.index("### The package, in one look"):readme.index("## Running a chapter")]
    layers = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert layers == sorted(re.findall(r"^\| `spectie/(\w+)/` \|", table, re.M)), layers
    unnamed = []
    for name in _modules():
        layer, _, module = name.rpartition(".")
        if not layer:  # a layer itself, or a module beside cli.py
            if name not in layers and f"`spectie/{name}.py`" not in table:
                unnamed.append(name)
            continue
        said = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
        if f"`{module}`" not in said and not any(module.startswith(p) for p in re.findall(r"`(\w+)\*`", said)):
            unnamed.append(name)
    assert not unnamed, f"modules no map names: {unnamed}"


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module and the modules of `modules` it imports (function-level imports included)."""
    return {name: {m for m in _spectie_imports(path.read_text()) if m in modules and m != name
                   and not name.startswith(m + ".")}  # a module's own package is not an import of it
            for name, path in modules.items()}


def test_imports_flow_one_way():
    """No two modules import each other, directly or through others (function-level imports included)."""
    graph = _import_graph(_modules())

    def cycle_from(start):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in map(cycle_from, sorted(graph)) if c]
    assert not cycles, f"import cycles: {cycles[:3]}"
    assert _module_file(PACKAGE, "engines.runner") == PACKAGE / "engines" / "runner.py"


LONGEST_CHAIN = 10  # modules, from `python -m spectie` (__main__) down


def _longest_chain(graph: dict[str, set[str]]) -> list[str]:
    import functools

    @functools.cache
    def down(name: str) -> tuple[str, ...]:
        return (name, *max((down(m) for m in graph[name]), key=len, default=()))

    return list(max((down(name) for name in graph), key=len))


def test_no_import_chain_is_longer_than_ten_modules():
    """Imports (function-level ones included) never run more than ten modules deep, `python -m spectie` included:
    what a layer needs from the one below is a step, not a climb through it."""
    graph = _import_graph({**_modules(), "__main__": PACKAGE / "__main__.py"})
    assert _longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == ["a", "b", "c"]
    chain = _longest_chain(graph)
    assert len(chain) <= LONGEST_CHAIN, " -> ".join(chain)


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts (pyproject.toml) over the package in `root`."""
    return subprocess.run([str(Path(sys.prefix) / "bin" / "lint-imports"), "--no-cache"], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)


def test_the_import_contract_holds_and_breaks_when_a_tool_imports_the_book(tmp_path):
    """The layers as a contract (`lint-imports`, pinned): each layer imports only those below it. A copy of the
    package in which a tool (the fix ledger) imports a chapter page breaks it, naming the import."""
    result = lint_imports(PACKAGE.parent)
    assert result.returncode == 0 and "1 kept, 0 broken" in result.stdout, result.stdout + result.stderr
    shutil.copytree(PACKAGE, tmp_path / "spectie", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PACKAGE.parent / "pyproject.toml", tmp_path)
    fixes = tmp_path / "spectie" / "tools" / "fixes.py"
    fixes.write_text(fixes.read_text() + "\nfrom spectie.book import pages  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1 and "Each layer imports only the layers below it BROKEN" in result.stdout, result.stdout
    assert "spectie.tools.fixes -> spectie.book.pages" in result.stdout, result.stdout


NOTEBOOKS = PACKAGE.parent / "notebooks"
LONGEST_CELL = 15  # lines: longer logic goes into a tested function of the package
LONGEST_FUNCTION = 50  # lines
LONGEST_MODULE = 450  # lines


def _code_cells():
    import json

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        for number, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                yield f"{path.name} cell {number}", cell, "".join(cell["source"])


def test_notebooks_only_narrate_and_glue():
    """No code cell over 15 lines; no record written and no environment named in a notebook's code (its parameters
    aside): every computation is a function of the package, which the tests exercise."""
    import yaml

    environment_ids = {yaml.safe_load(p.read_text())["id"] for p in (PACKAGE.parent / "environments").glob("*.yaml")}
    long, writing, named = [], [], []
    for where, cell, source in _code_cells():
        if len(source.rstrip("\n").splitlines()) > LONGEST_CELL:
            long.append(where)
        if "parameters" in cell["metadata"].get("tags", []):
            continue
        if re.search(r"\bwrite_\w*\(|\.write_text\(|json\.dump", source):
            writing.append(where)
        named += [f"{where}: {env}" for env in environment_ids if re.search(rf"[\"']{re.escape(env)}[\"']", source)]
    assert not long, f"code cells over {LONGEST_CELL} lines: {long}"
    assert not writing, f"notebook cells that write records: {writing}"
    assert not named, f"environment ids written into a notebook's code: {named}"


def _function_lengths():
    import ast

    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{name}.{node.name}", node.end_lineno - node.lineno + 1


def test_functions_and_modules_stay_small():
    long_functions = sorted(f"{name} ({lines})" for name, lines in _function_lengths() if lines > LONGEST_FUNCTION)
    assert not long_functions, f"functions over {LONGEST_FUNCTION} lines: {long_functions}"
    long_modules = sorted(f"{name} ({n})" for name, path in _modules().items()
                          if (n := len(path.read_text().splitlines())) > LONGEST_MODULE)
    assert not long_modules, f"modules over {LONGEST_MODULE} lines: {long_modules}"
