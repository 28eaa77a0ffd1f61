"""The CP package reads as one family (issue 29, item 4): small files, no private name imported across files, layout
names compared only through their constants, and a shallow import graph (each floor imports only floors below it).

Read from the source with `ast`; imports under `if TYPE_CHECKING:` are annotations, not runtime edges."""
import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
CP = ROOT / "parallelisms" / "cp"
CONSTANTS = CP / "layouts.py"
MAX_LINES, MAX_DEPTH = 400, 5


def cp_files() -> list[pathlib.Path]:
    return sorted(CP.glob("*.py"))


def runtime_imports(path: pathlib.Path) -> list[ast.ImportFrom | ast.Import]:
    """Every import of a file except those guarded by `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
               for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in guarded]


def cp_edges(path: pathlib.Path) -> set[str]:
    """The modules of parallelisms/cp a file imports at runtime (stems)."""
    found = set()
    for node in runtime_imports(path):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        found |= {name.split(".")[2] for name in names if name.startswith("parallelisms.cp.")}
    return found


def import_depth(files: list[pathlib.Path]) -> dict[str, int]:
    """Floors above a leaf (a module importing nothing of the package is floor 0): the longest import chain."""
    edges = {p.stem: cp_edges(p) for p in files}

    @functools.lru_cache(maxsize=None)
    def depth(stem: str) -> int:
        return max((1 + depth(dep) for dep in edges.get(stem, ())), default=0)

    return {stem: depth(stem) for stem in edges}


def documents_comparisons(path: pathlib.Path) -> list[int]:
    """Lines comparing something with the literal "documents" (==, !=, in, not in a tuple of literals)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = [c for o in operands for c in ([o] if isinstance(o, ast.Constant) else
                                                  getattr(o, "elts", []) if isinstance(o, (ast.Tuple, ast.List, ast.Set))
                                                  else [])]
        if any(isinstance(c, ast.Constant) and c.value == "documents" for c in literals):
            lines.append(node.lineno)
    return lines


def test_no_cp_file_is_over_400_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in cp_files()}
    assert len(sizes) >= 10 and max(sizes.values()) <= MAX_LINES, sizes


def test_no_private_name_is_imported_across_files():
    offenders = []
    for path in sorted((ROOT / "parallelisms").rglob("*.py")):
        for node in runtime_imports(path):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parallelisms"):
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not offenders, offenders


def test_documents_is_compared_only_through_its_constant():
    places = [ROOT / "parallelisms", ROOT / "bench", ROOT / "training", ROOT / "config", ROOT / "data", ROOT / "models"]
    found = {str(p.relative_to(ROOT)): lines for place in places for p in sorted(place.rglob("*.py"))
             if p != CONSTANTS and (lines := documents_comparisons(p))}
    assert not found, found


def test_the_detector_sees_a_comparison(tmp_path):
    """The rule above can fail: each spelling of a literal comparison is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text('a == "documents"\nb in ("zigzag", "documents")\n"documents" != c\nd == DOCUMENTS\n')
    assert documents_comparisons(probe) == [1, 2, 3]


def test_cp_import_depth_is_at_most_five_floors():
    depths = import_depth(cp_files())
    assert max(depths.values()) <= MAX_DEPTH, sorted(depths.items(), key=lambda kv: -kv[1])


def test_the_depth_counts_a_chain(tmp_path):
    """a -> b -> c is two floors above c; a TYPE_CHECKING import is no edge."""
    (tmp_path / "a.py").write_text("from parallelisms.cp.b import x\n")
    (tmp_path / "b.py").write_text("from parallelisms.cp.c import y\nif TYPE_CHECKING:\n    from parallelisms.cp.a import z\n")
    (tmp_path / "c.py").write_text("import torch\n")
    assert import_depth(sorted(tmp_path.glob("*.py"))) == {"a": 2, "b": 1, "c": 0}
