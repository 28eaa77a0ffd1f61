"""The training command line (`train.py [RECIPE.toml] [--section.key value ...] [mode flags]`) read without torch,
and the launch's first check on it.

run_train.sh runs `python -m config.command_line ARGS` before torchrun: a recipe that does not load (a missing
file, an unknown key, a value of the wrong type, an impossible combination `load_config` refuses) stops there in one
line, in a process that never imports torch (about 0.1 s of CPU where the launcher's own check, after importing torch
and the trainer, took about 2.5 s). Everything that needs torch or the data (degrees against ranks, devices, token
stores) is still checked by `train.py --check` in the launcher, which repeats this load.
"""
from __future__ import annotations

import sys

from config.errors import RecipeError
from config.recipe import default_recipe, load_config

MODE_FLAGS = ("--print-config", "--check", "--dry-run", "--prepare-data", "--json", "--plan-ramp")


def parse_cli(argv: list[str]) -> tuple[str, list[str], set[str]]:
    """(recipe path, overrides, mode flags): the first argument is the recipe unless it is an option."""
    flags = {a for a in argv if a in MODE_FLAGS}
    rest = [a for a in argv if a not in flags]
    recipe = default_recipe()
    if rest and not rest[0].startswith("--"):
        recipe, rest = rest[0], rest[1:]
    return recipe, rest, flags


def main(argv: list[str]) -> int:
    """Exit code 2 with train.py's one line (`error: ...` on stderr) when the recipe does not load, else 0."""
    recipe, overrides, _ = parse_cli(argv)
    try:
        load_config(recipe, overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
