"""The package's architecture as its imports: each package imports only the layers below it, sources and framework
glue are leaves that nothing below imports, and no module imports another that imports it back (local imports
included: a cycle hidden in a function is still a cycle)."""

import ast
from pathlib import Path

import loader

ROOT = Path(loader.__file__).parent
ALLOWED = {  # a part -> the parts its modules may import
    "core": {"core"},
    "streams": {"core", "streams"},
    "checkpoint": {"core", "streams", "checkpoint"},
    "metrics": {"metrics"},  # loader/metrics.py: counters and the stall warning, for the loader and its exporters
    "dataloader": {"core", "streams", "checkpoint", "metrics"},
    "sources": {"core", "streams", "sources"},
    "integrations": {"core", "streams", "checkpoint", "metrics", "dataloader", "sources", "integrations", "top"},
    "cli": {"core", "streams", "checkpoint", "metrics", "dataloader", "sources", "cli", "top"},
    "top": {"core", "streams", "checkpoint", "metrics", "dataloader", "cli"},  # loader/__init__.py, __main__.py
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ["loader", *path.relative_to(ROOT).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _part(module: str) -> str:
    parts = module.split(".")
    return "top" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


def _imports(module: str) -> set[str]:
    """The loader modules `module` imports anywhere in its body (a `from package import name` names a module when
    `name` is one)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names
            }
    return {name for name in found if name in MODULES and name != module}


def test_each_part_imports_only_the_parts_below_it():
    wrong = [f"{m} imports {i}" for m in MODULES for i in _imports(m) if _part(i) not in ALLOWED[_part(m)]]
    assert not wrong, wrong


def test_no_module_imports_in_a_cycle():
    graph = {m: _imports(m) for m in MODULES}
    done, path = set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done:
            return
        path.append(module)
        for other in sorted(graph[module]):
            if not other.startswith(module + ".") and not module.startswith(other + "."):  # a package and its own
                visit(other)  # modules: Python loads the package first, so that is not a cycle
        path.pop()
        done.add(module)

    for module in MODULES:
        visit(module)


def test_the_checker_sees_imports_and_parts():
    """Guards the two tests above against passing vacuously."""
    assert "loader.core.order" in _imports("loader.dataloader")
    assert _part("loader.sources.tokens") == "sources" and _part("loader") == "top"
    assert len(MODULES) > 30
