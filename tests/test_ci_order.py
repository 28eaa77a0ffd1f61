"""The CI order hint names real files: tests/conftest.py starts `LONGEST_FILES` first on CI's two xdist workers, and a
renamed or deleted file there would quietly put a long run back at the end."""
import os

from tests.conftest import LONGEST_FILES, ROOT


def test_every_longest_file_exists():
    assert [path for path in LONGEST_FILES if not os.path.isfile(os.path.join(ROOT, path))] == []
