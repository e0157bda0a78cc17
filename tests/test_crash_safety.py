"""Crashes lose nothing: a writer killed (SIGKILL) at random points while it saves a chat, the suffix
history, a pulled model or an export leaves the previous version whole under the final name, never a
partial one; a full disk gives one line and keeps what was there. The writers are tests/crash_writers.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import crash_writers
from crash_writers import KINDS, check

HERE = Path(__file__).resolve().parent
KILL_SEED = 25
KILLS = 8            # per kind: each a fresh writer killed after a random delay
MAX_DELAY_S = 0.6    # after the writer's first version is in place: a few more versions get written meanwhile


def _writer(kind: str, root: Path, first: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "crash_writers.py"), kind, str(root), str(first)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX")
@pytest.mark.parametrize("kind", KINDS)
def test_a_writer_killed_anywhere_leaves_the_previous_version_whole(kind, tmp_path):
    rng = random.Random(f"{KILL_SEED}-{kind}")
    last = None  # the newest version the writers said was in place
    for _ in range(KILLS):
        proc = _writer(kind, tmp_path, (last or 0) + 1)
        try:
            first = proc.stdout.readline()  # one version in place: there is a previous file to keep
            assert first.strip(), f"the writer failed: {proc.stderr.read()}"
            last = int(first)
            time.sleep(rng.uniform(0, MAX_DELAY_S))
        finally:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
        last = max([last, *map(int, out.split())])
        found = check(kind, tmp_path)  # raises on anything partial under the final name
        # The newest version announced is there, or the one after it (the kill came after os.replace,
        # before the print); nothing older: no version is lost.
        assert found in (last, last + 1), (kind, found, last)
        last = found
    # Only the final name and hidden temporary names (left by the kills; never read as the file).
    shown = {p.name for d in (tmp_path, tmp_path / "models") if d.is_dir() for p in d.iterdir()}
    assert {n for n in shown if not n.startswith(".")} <= _FINAL[kind], shown


_FINAL = {"chat": {"chat.state"}, "suffix": {"history.bin"}, "pull": {"models", "crash-model.gguf"},
          "export": {"bundle"}}


# --- a full disk ----------------------------------------------------------------------------------------

SIMULATED_FULL_DISK = r"""
import errno, os, runpy, stat, sys
real = os.fsync
def fsync(fd):  # a full disk, as a filesystem with delayed allocation reports it: at fsync
    if stat.S_ISREG(os.fstat(fd).st_mode):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(fd)
os.fsync = fsync
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs where this process may mount one (root on Linux), else None (the disk is simulated)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("kind", ["chat", "suffix", "pull"])  # an export's: tests/test_bundle.py
def test_a_full_disk_says_so_in_one_line_and_keeps_what_was_there(kind, tmp_path, small_disk, monkeypatch):
    root = small_disk or tmp_path
    monkeypatch.setattr(crash_writers, "SCALE", 1 / 16)  # version 1 fits
    monkeypatch.setenv("EDGESPEC_HOME", str(root))
    crash_writers.write(kind, root, 1)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    # version 2, twice the usual size, does not fit: a real small disk, or every fsync failing
    command = [str(HERE / "crash_writers.py"), kind, str(root), "2", "2", "once"]
    if small_disk is None:
        command = ["-c", SIMULATED_FULL_DISK, *command]
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120, cwd=HERE)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    name, line = proc.stdout.split("\n", 1)
    assert name == "DiskFullError" and "\n" not in line and line.startswith("no space left"), proc.stdout
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert after.keys() == before.keys() and after == before  # the previous version whole, nothing left behind
    assert check(kind, root) == 1
