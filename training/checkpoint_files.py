"""The checkpoint folder on disk: `step-<N>/` names, the manifest that makes a checkpoint complete, and its checks.

A save writes into `step-<N>.partial/`. Once every rank's DCP write has finished (DCP writes its `.metadata` only
after gathering every rank's results), the ranks checksum the files between them, rank 0 writes `checkpoint.json`
(each file's size and CRC32) and renames the folder to `step-<N>/`. A `step-<N>/` folder is therefore complete by
construction: a crash at any point leaves at most a `.partial` folder, which loading never looks at and the next
save of that step replaces. The checksums catch what a rename cannot: files damaged or lost after publishing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib

PARTIAL_SUFFIX = ".partial"
MANIFEST = "checkpoint.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 16 * 2**20


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def published_steps(folder: str) -> list[int]:
    """Steps with a published `step-<N>/` folder, ascending (partial folders are not listed)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(folder, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(root: str, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes": size, "crc32": checksum}} for files under `root`."""
    out = {}
    for name in names:
        path = os.path.join(root, name)
        out[name] = {"bytes": os.path.getsize(path), "crc32": file_crc32(path)}
    return out


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomically(path: str, content: dict | list) -> None:
    """Written beside `path`, synced, then renamed over it: a kill at any instant leaves the old file or the new."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(partial: str, final: str) -> None:
    """Rename `partial` to `final`; an older `final` (the same step saved again) is swapped out first."""
    replaced = final + ".replaced"
    if os.path.exists(final):
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(partial, final)
    _fsync_dir(os.path.dirname(final))
    shutil.rmtree(replaced, ignore_errors=True)


def prune(folder: str, keep_latest: int) -> list[int]:
    """Deletes published checkpoints beyond the newest `keep_latest` (0 keeps all) and leftover partial folders.

    Call only when no save is in flight."""
    removed = []
    steps = published_steps(folder)
    if keep_latest > 0:
        for step in steps[:-keep_latest]:
            shutil.rmtree(step_dir(folder, step), ignore_errors=True)
            removed.append(step)
    for name in os.listdir(folder):
        if name.endswith(PARTIAL_SUFFIX) or name.endswith(".replaced"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return removed


def read_manifest(directory: str) -> tuple[dict | None, str | None]:
    """(manifest, None) or (None, a problem naming the file)."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest.get("files"), dict) or ".metadata" not in manifest["files"]:
            raise ValueError("no file list")
        return manifest, None
    except FileNotFoundError:
        return None, f"checkpoint file '{path}' is missing (the checkpoint was not published by this trainer)"
    except (ValueError, OSError) as e:
        return None, f"checkpoint file '{path}' is unreadable ({e})"


def check_files(directory: str, files: dict[str, dict], checksum: list[str]) -> str | None:
    """The first problem with the listed files, naming the file: missing, wrong size, or (for the names in
    `checksum`) wrong CRC32. None when all is well."""
    for name in sorted(files):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            return f"checkpoint file '{path}' is missing"
        size = os.path.getsize(path)
        if size != files[name]["bytes"]:
            return f"checkpoint file '{path}' is corrupt ({size} bytes, {files[name]['bytes']} were written)"
    for name in sorted(checksum):
        path = os.path.join(directory, name)
        if file_crc32(path) != files[name]["crc32"]:
            return f"checkpoint file '{path}' is corrupt (CRC32 differs from the one recorded at save time)"
    return None
