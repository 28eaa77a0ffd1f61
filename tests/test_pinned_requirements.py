"""With transformers hidden (a shadow package that refuses to import, first on PYTHONPATH), a module that
`importorskip`s it fails the run instead of skipping; an unpinned package still skips."""
import os
import subprocess
import sys

from harness.launch_env import child_env
from tests.pinned_requirements import ROOT, pinned_packages


def test_the_pins_are_read():
    assert {"transformers", "torch", "safetensors", "pytest"} <= pinned_packages()


def _pytest_with_hidden_transformers(tmp_path, test_text: str) -> subprocess.CompletedProcess:
    shadow = tmp_path / "shadow" / "transformers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError('hidden by the test', name='transformers')\n")
    module = tmp_path / "case.py"
    module.write_text(test_text)
    # Under tests/ so the project's conftest applies; named after this test's own tmp_path so the two tests here,
    # run at once on two xdist workers, never share one link (a clean-clone CI failed on that race: File exists).
    probe = os.path.join(ROOT, "tests", f"_pinned_probe_{tmp_path.name}_test.py")
    os.symlink(module, probe)
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", probe],
                              capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env=child_env(str(tmp_path / "shadow")))
    finally:
        os.unlink(probe)


def test_missing_pinned_requirement_fails(tmp_path):
    done = _pytest_with_hidden_transformers(tmp_path, "import pytest\ntransformers = pytest.importorskip("
                                            "'transformers')\n\ndef test_x():\n    pass\n")
    assert done.returncode != 0 and "pinned in requirements.txt" in done.stdout, done.stdout[-2000:]


def test_missing_unpinned_package_still_skips(tmp_path):
    done = _pytest_with_hidden_transformers(tmp_path, "import pytest\n\ndef test_x():\n    pytest.importorskip("
                                            "'no_such_package_anywhere')\n")
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout[-2000:]
