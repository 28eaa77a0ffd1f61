"""`./run_train.sh --help`: the modes and sections, and every schema key under its section with its default and
docstring, printed without reading a recipe or starting a process."""
import dataclasses

import pytest

from config.help import TABLES, field_docs, help_text
from config.schema import SECTIONS, Config
from tests.trainer_runs import run_train


def test_help_prints_the_modes_and_sections_without_starting_anything():
    # A recipe that does not exist and a bad override: help reads neither, and no torchrun starts.
    result = run_train("missing.toml", "--training.stepz", "3", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for mode in ("--dry-run", "--check", "--plan-ramp", "--prepare-data", "--show-rows", "--section.key value"):
        assert mode in result.stdout, mode
    for section in SECTIONS:
        assert f"  {section} " in result.stdout, section
    assert result.stderr == "" and "torch.distributed" not in result.stdout


@pytest.mark.slow
def test_help_section_lists_each_key_from_the_schema():
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): a train.py --help launch per section, 19
    s."""
    result = run_train("-h", "training", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[training]")
    assert "  steps (int, default " in result.stdout


@pytest.mark.parametrize("section", [*SECTIONS, *TABLES])
def test_every_schema_key_appears_under_its_section(section):
    cls = TABLES[section] if section in TABLES else type(getattr(Config(), section))
    text, docs = help_text(section), field_docs(cls)
    for f in dataclasses.fields(cls):
        assert f"\n  {f.name} (" in text, (section, f.name)
        assert docs.get(f.name), f"{section}.{f.name} has no docstring in the schema"
        assert " ".join(docs[f.name].split()[:6]) in " ".join(text.split()), (section, f.name)


def test_an_unknown_help_section_is_one_line():
    with pytest.raises(Exception, match="--help trainig: no such recipe section. Did you mean 'training'"):
        help_text("trainig")
