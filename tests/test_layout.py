"""The package reads in one look: the README's map names every module, and imports flow one way."""

import re
from pathlib import Path

from spectie.chapters import _module_file, _spectie_imports

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


def test_the_readme_maps_every_module():
    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme[readme.index("### The package, in one look"):]
    named = set(re.findall(r"`(?:spectie/)?([\w/]+)\.py`", table)) | set(re.findall(r"`spectie/(\w+)/`", table))
    missing = [name for name in _modules() if name.split(".")[0] not in named and name.split(".")[-1] not in named]
    assert not missing, f"modules the README's package map does not name: {missing}"


def test_imports_flow_one_way():
    """No two modules import each other, directly or through others (function-level imports included)."""
    modules = _modules()
    graph = {name: {m for m in _spectie_imports(path.read_text()) if m in modules and m != name
                    and not name.startswith(m + ".")}  # a module's own package is not a cycle
             for name, path in modules.items()}

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
