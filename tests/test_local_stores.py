"""ollama: and lmstudio: names, on stores laid out in a temporary folder from their documented formats.

Ollama (docs/import.md and its server/manifest code): $OLLAMA_MODELS/manifests/HOST/NAMESPACE/NAME/TAG is a
Docker-v2-style JSON manifest; the layer of mediaType application/vnd.ollama.image.model is the GGUF,
stored as blobs/sha256-HEX. LM Studio: models/PUBLISHER/REPO/FILE.gguf.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.errors import ModelFileError
from edgespec.models import local_stores, store
from tiny_models import write_tiny_llama


def _blob(root: Path, data: bytes, media: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}


def add_ollama_model(root: Path, name: str, tag: str, gguf: bytes, host_ns=("registry.ollama.ai", "library")) -> Path:
    layers = [_blob(root, gguf, local_stores.OLLAMA_MODEL_LAYER),
              _blob(root, b"{{ .Prompt }}", "application/vnd.ollama.image.template"),
              _blob(root, b'{"stop": ["<|im_end|>"]}', "application/vnd.ollama.image.params")]
    config = _blob(root, json.dumps({"model_format": "gguf", "model_family": "llama"}).encode(),
                   "application/vnd.docker.container.image.v1+json")
    manifest = root.joinpath("manifests", *host_ns, name, tag)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2,
                                    "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                                    "config": config, "layers": layers}))
    return manifest


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("stores")
    return {"target": write_tiny_llama(d / "t.gguf", seed=0).read_bytes(),
            "draft": write_tiny_llama(d / "d.gguf", seed=1, perturb_from=0, perturb_scale=0.02).read_bytes()}


@pytest.fixture()
def stores(tmp_path, monkeypatch, ggufs):
    ollama = tmp_path / "ollama"
    add_ollama_model(ollama, "qwen2.5-coder", "1.5b", ggufs["target"])
    add_ollama_model(ollama, "tiny", "latest", ggufs["draft"])
    add_ollama_model(ollama, "model", "latest", ggufs["draft"], host_ns=("registry.ollama.ai", "someone"))  # USER/NAME
    add_ollama_model(ollama, "Tiny-GGUF", "Q4_K_M", ggufs["target"], host_ns=("hf.co", "bartowski"))
    lms = tmp_path / "lmstudio"
    (lms / "lmstudio-community" / "Tiny-GGUF").mkdir(parents=True)
    (lms / "lmstudio-community" / "Tiny-GGUF" / "Tiny-Q8_0.gguf").write_bytes(ggufs["target"])
    (lms / "lmstudio-community" / "Tiny-GGUF" / "Tiny-Q4_K_M.gguf").write_bytes(ggufs["draft"])
    (lms / "lmstudio-community" / "Tiny-GGUF" / "mmproj-Tiny-f16.gguf").write_bytes(b"GGUF")  # a projector: skipped
    (lms / "bartowski" / "Solo-GGUF").mkdir(parents=True)
    (lms / "bartowski" / "Solo-GGUF" / "solo.gguf").write_bytes(ggufs["draft"])
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("EDGESPEC_LMSTUDIO_MODELS", str(lms))
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "edgespec"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return {"ollama": ollama, "lmstudio": lms, "tmp": tmp_path}


def test_ollama_names_resolve_to_their_blobs_in_place(stores, ggufs):
    path = store.resolve("ollama:qwen2.5-coder:1.5b")
    sha = hashlib.sha256(ggufs["target"]).hexdigest()
    assert path == stores["ollama"] / "blobs" / f"sha256-{sha}"  # the blob itself: nothing copied
    assert store.resolve("ollama:tiny").read_bytes() == ggufs["draft"]  # tag defaults to latest
    assert store.resolve("ollama:someone/model:latest") == store.resolve("ollama:tiny")
    assert store.resolve("ollama:hf.co/bartowski/Tiny-GGUF:Q4_K_M") == path
    assert store.model_identity(path)["sha256"] == sha  # verified once, then identified by its digest


def test_ollama_missing_or_broken_models_say_what_to_do(stores):
    with pytest.raises(ModelFileError, match=r"Ollama has no model llama3.2:latest .*it has: .*qwen2.5-coder:1.5b.*"
                                             r"run `ollama pull llama3.2:latest`"):
        store.resolve("ollama:llama3.2")
    blob = store.resolve("ollama:qwen2.5-coder:1.5b")
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.unlink()
    blob.write_bytes(bytes(data))  # same size, other bytes, new inode: checked again
    with pytest.raises(ModelFileError, match="does not match its sha256"):
        store.resolve("ollama:qwen2.5-coder:1.5b")
    blob.write_bytes(bytes(data[:-10]))
    with pytest.raises(ModelFileError, match="its manifest says"):
        store.resolve("ollama:qwen2.5-coder:1.5b")
    with pytest.raises(ModelFileError, match="not an Ollama model name"):
        store.resolve("ollama:../../etc:x")


def test_lmstudio_names_pick_a_file_in_place(stores, ggufs):
    folder = stores["lmstudio"] / "lmstudio-community" / "Tiny-GGUF"
    assert store.resolve("lmstudio:lmstudio-community/Tiny-GGUF") == folder / "Tiny-Q4_K_M.gguf"
    assert store.resolve("lmstudio:lmstudio-community/Tiny-GGUF:Q8_0") == folder / "Tiny-Q8_0.gguf"
    assert store.resolve("lmstudio:lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf") == folder / "Tiny-Q8_0.gguf"
    assert store.resolve("lmstudio:bartowski/Solo-GGUF").name == "solo.gguf"  # the only file, no quant in its name
    with pytest.raises(ModelFileError, match="has no Q2_K GGUF; it has Q4_K_M, Q8_0"):
        store.resolve("lmstudio:lmstudio-community/Tiny-GGUF:Q2_K")
    with pytest.raises(ModelFileError, match="LM Studio has no someone/Else"):
        store.resolve("lmstudio:someone/Else")


def test_installed_lists_every_store_and_every_name_runs(stores):
    found = {m["name"]: m for m in store.installed()}
    expected = {"ollama:qwen2.5-coder:1.5b", "ollama:tiny:latest", "ollama:someone/model:latest",
                "ollama:hf.co/bartowski/Tiny-GGUF:Q4_K_M", "lmstudio:lmstudio-community/Tiny-GGUF:Q4_K_M",
                "lmstudio:lmstudio-community/Tiny-GGUF:Q8_0", "lmstudio:bartowski/Solo-GGUF/solo.gguf"}
    assert expected <= set(found), set(found)
    for name in expected:
        assert store.resolve(name) == found[name]["path"]


def _cli(args, stores) -> subprocess.CompletedProcess:
    env = {**os.environ, "OLLAMA_MODELS": str(stores["ollama"]), "EDGESPEC_LMSTUDIO_MODELS": str(stores["lmstudio"]),
           "EDGESPEC_HOME": str(stores["tmp"] / "edgespec"), "HF_HUB_CACHE": str(stores["tmp"] / "hf-cache"),
           "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_models_list_shows_the_other_stores(stores):
    done = _cli(["models", "list"], stores)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert rows["ollama:qwen2.5-coder:1.5b"][1] == "ollama"
    assert rows["lmstudio:lmstudio-community/Tiny-GGUF:Q8_0"][1] == "lmstudio"


def test_generate_with_an_ollama_target_and_an_lmstudio_draft(stores):
    done = _cli(["generate", "hello", "--target", "ollama:qwen2.5-coder:1.5b", "--draft",
                 "lmstudio:lmstudio-community/Tiny-GGUF", "--mode", "draft", "--raw", "--temperature", "0",
                 "--max-tokens", "8", "--ctx", "256", "--json"], stores)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["generated"] == 8
    missing = _cli(["generate", "hello", "--target", "ollama:nope"], stores)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr


def test_an_empty_machine_lists_no_other_stores(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    monkeypatch.setenv("EDGESPEC_LMSTUDIO_MODELS", str(tmp_path / "none2"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "none3"))
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "es"))
    assert store.installed() == []
