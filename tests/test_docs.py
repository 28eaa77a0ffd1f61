"""The README and docs/ as a newcomer meets them: every page reachable from the README, every relative link and
anchor resolving, and every fenced block marked `bash cpu-runnable` running as written (docs/testing.md)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "bash cpu-runnable"
# Pages written on other branches in the same round, linked from the README before they land; once a page exists it
# is checked like every other. Empty this set after the merge.
AWAITED_PAGES: set[str] = set()  # pages linked before they exist (none now)
_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def _prose(text: str) -> str:
    """The page without its fenced blocks (a link inside code is not a link)."""
    return _FENCE.sub("", text)


def links(page: pathlib.Path) -> list[str]:
    return [a or b for a, b in _LINK.findall(_prose(page.read_text()))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in _prose(page.read_text()).splitlines() if line.startswith("#")}


def _local_target(page: pathlib.Path, link: str) -> tuple[pathlib.Path, str] | None:
    if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
        return None
    path, _, anchor = link.partition("#")
    return (page if not path else (page.parent / path).resolve()), anchor


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for link in links(page):
        target = _local_target(page, link)
        if target is None:
            continue
        path, anchor = target
        if not path.exists():
            if path.name not in AWAITED_PAGES:
                broken.append(f"{link}: no such file")
            continue
        if anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading '#{anchor}' in {path.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or not page.exists():
            continue
        seen.add(page)
        for link in links(page):
            target = _local_target(page, link)
            if target and target[0].suffix == ".md":
                todo.append(target[0])
    unreachable = [p.name for p in PAGES if p not in seen]
    assert not unreachable, f"docs pages no link from the README leads to: {unreachable}"


def test_readme_is_short_and_names_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "./run_train.sh" in text and "./run_tests.sh" in text
    assert "## Before your first cluster run" in text and "docs/first_cluster_run.md" in text


def runnable_blocks() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(ROOT)}#{i}", body) for page in PAGES
            for i, (info, body) in enumerate(_FENCE.findall(page.read_text())) if info.strip() == RUNNABLE]


def test_some_blocks_are_marked_runnable():
    assert len(runnable_blocks()) >= 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where, block", runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_runnable_block_runs_as_written(where, block):
    env = dict(os.environ, PYTHON=sys.executable,
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    env.pop("NPROC", None)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{where}:\n{block}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
