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
