"""`./run_train.sh --help [SECTION]`: the launcher's modes and how overrides work, and each recipe key with its type,
default and docstring, read from the schema's dataclasses themselves (config/schema.py, config/schema_data.py,
config/schema_run.py, config/schema_hardware.py), so a key added there appears here without editing this file.

The field docstrings are attribute docstrings (a string right after the field), which Python does not keep at run
time: they are read from the dataclass's source with `ast`.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import typing
from typing import Literal

from config.errors import RecipeError
from config.schema import SECTIONS, Config, RampTable, SourceConfig

MODES = """\
usage: ./run_train.sh [RECIPE.toml] [--section.key value ...] [MODE]

Without a mode: validates the recipe and the launch in one process, then trains on the ranks it needs under torchrun
(NPROC=N local ranks; inside a job of slurm/train.sbatch, every node of the job). The default recipe is
recipes/debug.toml.

modes (one process, no torchrun):
  --check           validate the recipe and the launch, prepare a missing token store, print the ranks it needs
  --dry-run         memory per rank and step time of every stage on a fake process group (no GPU needed)
  --plan-ramp --gpus N --target-seq-len L [--out F] [--offload auto|on|off] [--stages K] [--tokens-per-stage T]
                    write a recipe whose [[ramp]] stages grow the context to L on N GPUs, each measured to fit
  --prepare-data    tokenize the recipe's sources into their memory-mapped stores (data.cache_dir), then stop
  --show-rows N [--json]
                    print the first N training rows of the first stage (label spans, sources), then stop
  --print-config    print the recipe with the overrides applied, as TOML
  --help [SECTION]  this text; with a section, each of its keys with its type, default and meaning

overrides: any recipe key as --section.key value or --section.key=value (e.g. --training.steps 5
  --checkpoint.enable true); they apply after the recipe file. Lists and tables take TOML text
  (--eval.niah_lengths "[4096, 8192]"). [[ramp]] stages are written in the recipe file.

environment: NPROC=N local ranks (default: the product of the recipe's parallel degrees); MAX_RESTARTS=N restarts
  after a dead rank from the newest complete checkpoint; RANK_START=exec starts each rank as a fresh interpreter
  (default fork: from the launcher's imports); PYTHON, TORCH_SPEC: see bootstrap.sh.
"""


TABLES = {"ramp": RampTable, "data.sources": SourceConfig}
"""The arrays of tables ([[ramp]], [[data.sources]]): written in the recipe file, not as overrides."""


def _section_class(section: str) -> type:
    return TABLES[section] if section in TABLES else type(getattr(Config(), section))


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its attribute docstring, whitespace collapsed} from the class's source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(hint) -> str:
    if typing.get_origin(hint) is Literal:
        return " | ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in typing.get_args(hint))
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _default(f: dataclasses.Field):
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value).replace("'", '"')


def section_keys(section: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, docstring) of every key of `section`, in the schema's order."""
    cls = _section_class(section)
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    return [(f.name, _type_name(hints[f.name]), _default(f), docs.get(f.name, ""))
            for f in dataclasses.fields(cls)]


def help_text(section: str | None = None) -> str:
    """The whole launcher help (`section` None), or one section's keys."""
    names = [*SECTIONS, *TABLES]
    if section is None:
        return MODES + "\nsections (./run_train.sh --help SECTION lists its keys):\n" + "".join(
            f"  {name}{' ' * (26 - len(name))}{len(section_keys(name))} keys\n" for name in names)
    if section not in names:
        match = difflib.get_close_matches(section, names, n=1)
        hint = f"Did you mean '{match[0]}'?" if match else f"Sections: {', '.join(names)}."
        raise RecipeError(f"--help {section}: no such recipe section. {hint}")
    lines = [f"[[{section}]]  (tables in the recipe file)" if section in TABLES
             else f"[{section}]  (override: --{section}.KEY VALUE)"]
    for key, kind, default, doc in section_keys(section):
        lines.append(f"  {key} ({kind}, default {default})")
        lines.extend(textwrap.wrap(doc, 112, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines) + "\n"
