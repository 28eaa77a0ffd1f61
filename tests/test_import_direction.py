"""Imports run one way: config <- data, models, parallelisms <- training <- train.py.

Read from the source with `ast` (every import, module-level or inside a function), so a lazy import cannot hide a
cycle."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = ("config", "data", "models", "parallelisms", "training", "train")


def imported_packages(path: pathlib.Path) -> set[str]:
    """The project packages (and train.py) a file imports, as top-level names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names if name.split(".")[0] in PROJECT}
    return found


def package_files(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_the_package_lists_are_not_empty():
    for package in ("config", "data", "models", "parallelisms", "training"):
        assert package_files(package), package


def test_config_imports_no_other_project_package():
    for path in package_files("config"):
        assert imported_packages(path) <= {"config"}, path


@pytest.mark.parametrize("package", ["data", "models", "parallelisms"])
def test_lower_packages_never_import_training_or_train(package):
    for path in package_files(package):
        assert not imported_packages(path) & {"training", "train"}, path


def test_training_never_imports_train():
    for path in package_files("training"):
        assert "train" not in imported_packages(path), path


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every dotted module a file imports (`from training import step` counts as training.step)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_evaluation_never_imports_planning():
    """Planning measures evaluation (the dry run runs each stage's evaluations), so the arrow points one way only."""
    files = package_files("training/evaluation")
    assert files
    for path in files:
        assert not {name for name in imported_modules(path) if name.startswith("training.planning")}, path


def product_modules() -> dict[str, pathlib.Path]:
    """Every product module by dotted name (a package by its __init__.py), train.py included."""
    modules = {"train": ROOT / "train.py"}
    for package in PROJECT[:-1]:
        for path in package_files(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_edges(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The product modules `name` imports anywhere in its file (functions and TYPE_CHECKING blocks too): `from X
    import y` is X.y where that is a module, else X; relative imports resolve against the file's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each strongly connected group of modules (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
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
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, staying inside the group."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & group):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(group)


def test_no_import_cycle_in_the_product():
    """A cycle makes import order matter and hides which module owns a name: the shared name belongs to the lower
    module. Every import counts, lazy or TYPE_CHECKING, since each is a promise that the other module comes first."""
    modules = product_modules()
    graph = {name: module_edges(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 100
    assert "training.step" in graph["training.planning.memory_probe"]  # `from training import step`: the submodule
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_finds_a_cycle():
    """The test above can fail: a cycle through three modules is named in order (a file's import of its own name, a
    no-op, is none)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]


def test_module_edges_resolve_submodules_relative_and_lazy_imports(tmp_path):
    path = tmp_path / "pkg" / "sub" / "mod.py"
    path.parent.mkdir(parents=True)
    path.write_text("from . import other\nfrom ..top import thing\n\n\ndef f():\n    import pkg.lazy\n")
    modules = {name: tmp_path for name in ("pkg", "pkg.sub", "pkg.sub.mod", "pkg.sub.other", "pkg.top", "pkg.lazy")}
    assert module_edges("pkg.sub.mod", path, modules) == {"pkg.sub.other", "pkg.top", "pkg.lazy"}
