"""The package's import graph, read from its sources with ast (nothing is imported): no cycles,
no reach past the kernels' entry point, no file over the line budget.

Every import counts, also one inside a function. Importing `packlora.a.b` also runs the
`packlora.a` package's `__init__`, so it counts as an import of that package too (the root
package excepted: every module sits under it)."""
import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400


def package_modules():
    """{dotted module name: path} for every module pyproject maps into the package."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    modules = {}
    for pkg, folder in cfg["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((ROOT / folder).glob("*.py")):
            modules[pkg if path.name == "__init__.py" else f"{pkg}.{path.stem}"] = path
    return modules


def _absolute(module, is_pkg, level, target):
    if level == 0:
        return target or ""
    parts = module.split(".") if is_pkg else module.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def imported_names(module, path):
    """Dotted names `module` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_pkg, node.level, node.module)
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def import_graph(modules):
    root = min(modules, key=len)
    graph = {m: set() for m in modules}
    for m, path in modules.items():
        for name in imported_names(m, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if not name:
                continue
            parent = name.rpartition(".")[0]
            while parent not in ("", root):  # the packages whose __init__ runs first
                if parent in modules and not m.startswith(parent + ".") and parent != m:
                    graph[m].add(parent)
                parent = parent.rpartition(".")[0]
            if name != m:
                graph[m].add(name)
    return graph


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _without_root_reexports(graph, modules):
    """The root package's __init__ re-exports the public API: an import of the root package from
    inside it (`from .. import x` of a sibling) is an import of that sibling, not of the API."""
    root = min(modules, key=len)
    return {m: {n for n in deps if n != root} for m, deps in graph.items()}


MODULES = package_modules()
GRAPH = _without_root_reexports(import_graph(MODULES), MODULES)


def test_the_graph_covers_the_package():
    assert len(MODULES) > 80
    assert "packlora.tracker" in MODULES and "packlora.memory" in MODULES
    assert GRAPH["packlora.device"] >= {"packlora.tracker"}


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_tracker_imports_nothing_of_packlora():
    assert GRAPH["packlora.tracker"] == set()


@pytest.mark.parametrize("backend", ["packlora.kernels.cpu", "packlora.kernels.cuda"])
def test_only_kernels_reach_their_backends(backend):
    reach = sorted(f"{m} -> {n}" for m, deps in GRAPH.items() for n in deps
                   if (n == backend or n.startswith(backend + "."))
                   and not m.startswith("packlora.kernels"))
    assert not reach, "use packlora.kernels' entry point instead:\n" + "\n".join(reach)


def test_files_within_the_line_budget():
    big = {str(p.relative_to(ROOT)): n for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"files over {MAX_LINES} lines: {big}"


def test_the_graph_sees_imports_inside_functions(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from .b import x\n")
    names = set(imported_names("pkg.m", mod))
    assert "pkg.b" in names and "pkg.b.x" in names
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
