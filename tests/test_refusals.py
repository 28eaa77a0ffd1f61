"""One exception type for runtime refusals (config.errors.Refusal), the recipe's error only where a recipe key is at
fault: parallelisms/ and training/ raise no bare ValueError / NotImplementedError of their own."""
import ast
import pathlib

import pytest

from config import RecipeError, Refusal

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (file, message start): a ValueError raised and caught inside the same function, never seen by a caller.
CAUGHT_INSIDE = {("training/checkpoint_files.py", "no file list")}


def raised_builtins(path: pathlib.Path) -> list[tuple[str, str]]:
    """(exception name, message start) of every `raise ValueError(...)` / `raise NotImplementedError(...)` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
            name = node.exc.func.id
            if name in ("ValueError", "NotImplementedError"):
                first = node.exc.args[0] if node.exc.args else None
                text = first.value if isinstance(first, ast.Constant) else ast.unparse(first) if first else ""
                found.append((name, text))
    return found


def test_runtime_code_refuses_with_one_type():
    files = sorted((ROOT / "parallelisms").rglob("*.py")) + sorted((ROOT / "training").rglob("*.py"))
    assert len(files) > 20
    stray = [(str(path.relative_to(ROOT)), name, text) for path in files for name, text in raised_builtins(path)
             if (str(path.relative_to(ROOT)), text) not in CAUGHT_INSIDE]
    assert not stray, stray


def test_refusal_is_a_value_error_and_not_a_recipe_error():
    assert issubclass(Refusal, ValueError)  # callers that catch bad values keep working
    assert not issubclass(Refusal, RecipeError) and not issubclass(RecipeError, Refusal)


def test_cp_refusals_are_the_one_type():
    from parallelisms.context_parallel import UnsupportedAttentionError

    assert UnsupportedAttentionError is Refusal


def test_runtime_refusals_raise_it():
    import torch

    from parallelisms.cp.kernel_blocks import kernel_for
    from training.lr_schedule import lr_multiplier

    with pytest.raises(Refusal, match="mps"):
        kernel_for("mps", torch.float32, 64, False)
    with pytest.raises(Refusal, match="decay_type"):
        lr_multiplier(5, 1, 10, "stepwise", 0.1)
