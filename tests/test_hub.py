"""hf:OWNER/REPO names through the real huggingface_hub client against a loopback hub (tests/hub_server.py).

The repos hold tiny GGUFs the tests generate (real llama.cpp models; their quant labels are only names),
single-file and split, plus the hub's failure modes: a connection dropped mid-file, bytes that do not
match the listed sha256, a gated repo, an unknown repo, a repo without GGUFs, no network, offline mode.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.errors import CatalogError, ModelFileError
from edgespec.models import hub, store
from hub_server import HubServer
from tiny_models import write_tiny_llama

SPLIT_SHARDS = 3


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("hubmodels")
    target = write_tiny_llama(d / "t.gguf", seed=0).read_bytes()
    draft = write_tiny_llama(d / "d.gguf", seed=1, perturb_from=0, perturb_scale=0.02).read_bytes()
    other = write_tiny_llama(d / "v1.gguf", seed=7).read_bytes()
    # Over huggingface_hub's 10 MiB write chunk (constants.DOWNLOAD_CHUNK_SIZE): a connection dropped
    # within the first chunk leaves nothing to resume from.
    big = write_tiny_llama(d / "big.gguf", seed=3, n_embd=384, n_ff=1536).read_bytes()
    first = write_tiny_llama(d / "split" / "Split-Q8_0.gguf", seed=0, split_max_tensors=8)
    shards = {p.name: p.read_bytes() for p in sorted(first.parent.glob("Split-Q8_0-*-of-*.gguf"))}
    assert len(shards) == SPLIT_SHARDS
    return {"target": target, "draft": draft, "other": other, "big": big, **shards}


@pytest.fixture(scope="module")
def hub_server(tiny_files):
    with HubServer() as server:
        server.add("tiny/Tiny-GGUF", {"Tiny-Q8_0.gguf": tiny_files["target"], "Tiny-Q4_K_M.gguf": tiny_files["draft"],
                                      "README.md": b"# tiny\n"},
                   refs={"v1": {"Tiny-Q8_0.gguf": tiny_files["other"]}})
        server.add("tiny/Split-GGUF", {**{f"Q8_0/{k}": v for k, v in tiny_files.items() if k.startswith("Split-")},
                                       "Split-F32.gguf": tiny_files["target"]})
        server.add("tiny/Drop-GGUF", {"Drop-Q4_K_M.gguf": tiny_files["big"]})
        server.add("tiny/Corrupt-GGUF", {"Corrupt-Q4_K_M.gguf": tiny_files["draft"]})
        server.add("tiny/Gated-GGUF", {"Gated-Q4_K_M.gguf": tiny_files["draft"]}, gated=True)
        server.add("tiny/NoGGUF", {"config.json": b"{}", "model.safetensors": b"\0" * 64})
        yield server


@pytest.fixture()
def hub_env(hub_server, tmp_path, monkeypatch):
    """The client pointed at the loopback hub, with its cache, home and edgespec's cache in tmp."""
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "edgespec"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub_server.state.requests.clear()
    return tmp_path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


def test_names_parse_and_bad_names_say_the_grammar():
    assert hub.parse("hf:bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M") == hub.HubRef(
        "bartowski/Qwen2.5-7B-Instruct-GGUF", None, "Q4_K_M", None)
    assert hub.parse("hf:o/r@v1.2/sub/x-Q8_0.gguf") == hub.HubRef("o/r", "v1.2", None, "sub/x-Q8_0.gguf")
    assert hub.parse("hf:o/r@abc:Q8_0").name == "hf:o/r@abc:Q8_0"
    for bad in ("hf:", "hf:justaname", "hf:o/r:", "hf:o/r:Q4 K"):
        with pytest.raises(ModelFileError, match="hf:OWNER/REPO"):
            hub.parse(bad)
    from edgespec.loader import model_id

    assert model_id("hf:o/r:Q8_0") == "hf:o/r:Q8_0"  # what `serve` answers in /v1/models


def test_quant_pick_defaults_to_q4_k_m_and_files_land_in_the_hf_cache(hub_env, tiny_files):
    path = store.resolve("hf:tiny/Tiny-GGUF")
    assert path.name == "Tiny-Q4_K_M.gguf" and path.read_bytes() == tiny_files["draft"]
    assert str(path).startswith(str(hub_env / "hf-cache" / "models--tiny--Tiny-GGUF" / "snapshots"))
    assert path.resolve().name == _sha(tiny_files["draft"])  # the cache's blob, no copy elsewhere
    q8 = store.resolve("hf:tiny/Tiny-GGUF:q8_0")  # quant names are case-insensitive
    assert q8.name == "Tiny-Q8_0.gguf" and q8.read_bytes() == tiny_files["target"]
    by_file = store.resolve("hf:tiny/Tiny-GGUF/Tiny-Q8_0.gguf")
    assert by_file == q8


def test_cached_names_do_not_touch_the_hub(hub_env, hub_server):
    store.resolve("hf:tiny/Tiny-GGUF:Q8_0")
    hub_server.state.requests.clear()
    assert store.resolve("hf:tiny/Tiny-GGUF:Q8_0").name == "Tiny-Q8_0.gguf"
    assert hub_server.state.requests == []


def test_a_missing_quant_lists_the_quants_the_repo_has(hub_env):
    with pytest.raises(ModelFileError, match=r"hf:tiny/Tiny-GGUF has no Q5_K_M GGUF; it has Q4_K_M, Q8_0"):
        store.resolve("hf:tiny/Tiny-GGUF:Q5_K_M")
    with pytest.raises(ModelFileError, match="has no file nope.gguf; its GGUF files: Tiny-Q4_K_M.gguf, Tiny-Q8_0.gguf"):
        store.resolve("hf:tiny/Tiny-GGUF/nope.gguf")
    assert not (hub_env / "hf-cache" / "models--tiny--Tiny-GGUF" / "blobs").exists()  # nothing fetched


def test_a_split_model_is_fetched_whole_and_llama_cpp_loads_it(hub_env, hub_server, tiny_files):
    from conftest import load_runtime

    path = store.resolve("hf:tiny/Split-GGUF:Q8_0")
    assert path.name == "Split-Q8_0-00001-of-00003.gguf"
    shards = sorted(p.name for p in path.parent.iterdir())
    assert shards == [f"Split-Q8_0-{i:05d}-of-{SPLIT_SHARDS:05d}.gguf" for i in range(1, SPLIT_SHARDS + 1)]
    for name in shards:
        assert (path.parent / name).read_bytes() == tiny_files[name]
    rt = load_runtime(path, n_ctx=256)
    try:
        assert rt.n_vocab == 300
    finally:
        rt.close()
    with pytest.raises(ModelFileError, match="shard 2 of a split model; name its first shard"):
        store.resolve("hf:tiny/Split-GGUF/Q8_0/Split-Q8_0-00002-of-00003.gguf")


def test_an_interrupted_download_resumes_where_it_stopped(hub_env, hub_server, tiny_files):
    size = len(tiny_files["big"])
    cut = size - 1000
    hub_server.state.drop_once[("tiny/Drop-GGUF", "Drop-Q4_K_M.gguf")] = cut
    path = store.resolve("hf:tiny/Drop-GGUF")
    assert path.read_bytes() == tiny_files["big"]
    gets = [r for m, r in hub_server.gets("Drop-Q4_K_M.gguf") if m == "GET"]
    assert len(gets) == 2 and gets[0] is None, gets
    start = int(gets[1].removeprefix("bytes=").rstrip("-"))  # the second GET asked only for the rest
    assert 10 * 2**20 <= start <= cut, (start, cut, size)


def test_a_failed_download_resumes_on_the_next_run(hub_env, hub_server, tiny_files, monkeypatch):
    """What the error promises: run the command again and the download goes on from the .incomplete blob."""
    monkeypatch.setattr(hub, "ATTEMPTS", 1)  # no retry within this run
    hub_server.state.drop_once[("tiny/Drop-GGUF", "Drop-Q4_K_M.gguf")] = len(tiny_files["big"]) - 1000
    with pytest.raises(CatalogError, match="cannot reach the hub .*run the command again \\(a download resumes"):
        store.resolve("hf:tiny/Drop-GGUF")
    blobs = hub_env / "hf-cache" / "models--tiny--Drop-GGUF" / "blobs"
    [partial] = list(blobs.iterdir())
    kept = partial.stat().st_size
    assert partial.name == f"{_sha(tiny_files['big'])}.incomplete" and kept >= 10 * 2**20
    assert store.resolve("hf:tiny/Drop-GGUF").read_bytes() == tiny_files["big"]
    gets = [r for m, r in hub_server.gets("Drop-Q4_K_M.gguf") if m == "GET"]
    assert gets == [None, f"bytes={kept}-"], gets


def test_a_wrong_checksum_is_refused_and_nothing_stays_under_the_name(hub_env, hub_server, tiny_files):
    hub_server.state.corrupt.add(("tiny/Corrupt-GGUF", "Corrupt-Q4_K_M.gguf"))
    try:
        with pytest.raises(CatalogError, match="failed its sha256 check.*deleted"):
            store.resolve("hf:tiny/Corrupt-GGUF")
    finally:
        hub_server.state.corrupt.clear()
    root = hub_env / "hf-cache" / "models--tiny--Corrupt-GGUF"
    assert not (root / "blobs" / _sha(tiny_files["draft"])).exists()
    assert not [p for p in (root / "snapshots").rglob("*") if p.name.endswith(".gguf") or p.is_symlink()]
    assert not list((root / "blobs").iterdir())  # no blob, no .incomplete
    # The hub serves good bytes again: the next pull succeeds.
    assert store.resolve("hf:tiny/Corrupt-GGUF").read_bytes() == tiny_files["draft"]


def test_gated_repo_needs_a_token_with_access(hub_env, hub_server, monkeypatch):
    with pytest.raises(CatalogError, match=r"is gated: accept its terms on .* then set HF_TOKEN or run `hf auth login`"):
        store.resolve("hf:tiny/Gated-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(CatalogError, match="your token has no access yet"):
        store.resolve("hf:tiny/Gated-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert store.resolve("hf:tiny/Gated-GGUF").name == "Gated-Q4_K_M.gguf"
    auth = {a for _, p, _, a in hub_server.state.requests if "Gated" in p}
    assert "Bearer hf_test_token" in auth


def test_unknown_repo_no_gguf_and_unknown_revision(hub_env):
    with pytest.raises(ModelFileError, match="no model repository tiny/Nope on .*check the name"):
        store.resolve("hf:tiny/Nope")
    with pytest.raises(ModelFileError, match="hf:tiny/NoGGUF holds no GGUF model file"):
        store.resolve("hf:tiny/NoGGUF")
    with pytest.raises(ModelFileError, match="has no revision 'v9'"):
        store.resolve("hf:tiny/Tiny-GGUF@v9")


def test_revision_pinning_fetches_that_revision(hub_env, tiny_files):
    pinned = store.resolve("hf:tiny/Tiny-GGUF@v1:Q8_0")
    assert pinned.read_bytes() == tiny_files["other"]
    assert store.resolve("hf:tiny/Tiny-GGUF:Q8_0").read_bytes() == tiny_files["target"]


def test_offline_mode_uses_the_cache_and_says_what_is_missing(hub_env, hub_server, monkeypatch, tiny_files):
    store.resolve("hf:tiny/Tiny-GGUF:Q8_0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", _closed_port_url())
    hub_server.state.requests.clear()
    assert store.resolve("hf:tiny/Tiny-GGUF:Q8_0").read_bytes() == tiny_files["target"]
    path, was_cached = hub.pull("hf:tiny/Tiny-GGUF:Q8_0")
    assert was_cached and path.name == "Tiny-Q8_0.gguf"
    with pytest.raises(ModelFileError, match="HF_HUB_OFFLINE is set and hf:tiny/Tiny-GGUF:Q4_K_M is not in the "
                       "Hugging Face cache"):
        store.resolve("hf:tiny/Tiny-GGUF:Q4_K_M")
    assert hub_server.state.requests == []


def test_no_network_says_so(hub_env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", _closed_port_url())
    with pytest.raises(CatalogError, match="cannot reach the hub at http://127.0.0.1:.*check the network"):
        store.resolve("hf:tiny/Tiny-GGUF")


def test_a_tampered_cached_file_is_refused_before_use(hub_env, tiny_files):
    path = store.resolve("hf:tiny/Tiny-GGUF:Q8_0")
    blob = path.resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CatalogError, match="failed its sha256 check"):
        store.resolve("hf:tiny/Tiny-GGUF:Q8_0")
    assert not blob.exists() and not path.exists()


def test_cache_listing_names_what_is_there(hub_env):
    store.resolve("hf:tiny/Tiny-GGUF:Q8_0")
    store.resolve("hf:tiny/Split-GGUF:Q8_0")
    listed = {m["name"]: m for m in hub.cached_models()}
    assert set(listed) == {"hf:tiny/Tiny-GGUF:Q8_0", "hf:tiny/Split-GGUF:Q8_0"}
    assert listed["hf:tiny/Split-GGUF:Q8_0"]["bytes"] == sum(
        p.stat().st_size for p in listed["hf:tiny/Split-GGUF:Q8_0"]["path"].parent.iterdir())
    for name, m in listed.items():
        assert store.resolve(name) == m["path"]  # every listed name runs


# --- through the CLI, in a fresh process --------------------------------------------------------

def _cli(args: list[str], env_dir: Path, hub_url: str, **extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(env_dir / "hf-cache"),
           "HF_HOME": str(env_dir / "hf-home"), "EDGESPEC_HOME": str(env_dir / "edgespec"), **extra}
    env.pop("HF_TOKEN", None)
    env.pop("HF_HUB_OFFLINE", None)
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_generate_end_to_end_from_hub_names(hub_env, hub_server):
    done = _cli(["generate", "hello there", "--target", "hf:tiny/Tiny-GGUF:Q8_0", "--draft", "hf:tiny/Tiny-GGUF",
                 "--mode", "draft", "--raw", "--temperature", "0", "--max-tokens", "12", "--ctx", "256", "--json"],
                hub_env, hub_server.url)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["stats"]["generated"] == 12 and out["stats"]["drafted"] > 0
    # The same names offline, from the cache, give the same greedy text.
    again = _cli(["generate", "hello there", "--target", "hf:tiny/Tiny-GGUF:Q8_0", "--raw", "--temperature", "0",
                  "--max-tokens", "12", "--ctx", "256", "--json"], hub_env, _closed_port_url(), HF_HUB_OFFLINE="1")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["tokens"] == out["tokens"]


@pytest.mark.parametrize("name, message", [
    ("hf:tiny/Nope", "error: no model repository tiny/Nope"),
    ("hf:tiny/Gated-GGUF", "error: hf:tiny/Gated-GGUF is gated"),
    ("hf:tiny/NoGGUF", "error: hf:tiny/NoGGUF holds no GGUF model file"),
    ("hf:tiny/Tiny-GGUF:IQ2_XS", "error: hf:tiny/Tiny-GGUF has no IQ2_XS GGUF; it has Q4_K_M, Q8_0"),
])
def test_bad_hub_names_are_one_line_and_exit_2(hub_env, hub_server, name, message):
    done = _cli(["models", "pull", name], hub_env, hub_server.url)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr


def test_no_network_through_the_cli(hub_env):
    done = _cli(["models", "pull", "hf:tiny/Tiny-GGUF"], hub_env, _closed_port_url())
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: cannot reach the hub at http://127.0.0.1:")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_models_pull_reports_and_skips_cached(hub_env, hub_server):
    first = _cli(["models", "pull", "hf:tiny/Split-GGUF:Q8_0"], hub_env, hub_server.url)
    assert first.returncode == 0, first.stderr
    assert "hf:tiny/Split-GGUF:Q8_0: pulled, sha256 verified" in first.stderr
    again = _cli(["models", "pull", "hf:tiny/Split-GGUF:Q8_0"], hub_env, hub_server.url)
    assert "already cached" in again.stderr, again.stderr



def test_a_checkpoint_repo_is_snapshotted_for_export(hub_env, hub_server, hf_tiny):
    """`edgespec export hf:OWNER/REPO`: the checkpoint's config, safetensors and tokenizer from the HF cache,
    sha256-checked, read by the exporter's own checkpoint loader."""
    from edgespec.exporters.checkpoint import load_checkpoint

    ckpt = hf_tiny["llama"]
    files = {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    hub_server.add("tiny/Ckpt", {**files, "pytorch_model.bin": b"not wanted", "onnx/model.onnx": b"nor this"})
    loaded = load_checkpoint("hf:tiny/Ckpt")
    assert loaded.path.parent.name == "snapshots" and loaded.config["num_hidden_layers"] > 0
    assert sorted(p.relative_to(loaded.path).as_posix() for p in loaded.path.rglob("*") if p.is_file()) == sorted(files)
    with pytest.raises(ModelFileError, match="hf:tiny/Tiny-GGUF has no safetensors weights"):
        load_checkpoint("hf:tiny/Tiny-GGUF")


def test_models_rm_deletes_a_hub_model_and_nothing_else(hub_env, hub_server, tiny_files):
    q8 = store.resolve("hf:tiny/Tiny-GGUF:Q8_0")
    q4 = store.resolve("hf:tiny/Tiny-GGUF:Q4_K_M")
    done = _cli(["models", "rm", "hf:tiny/Tiny-GGUF:Q8_0"], hub_env, hub_server.url)
    assert done.returncode == 0, done.stderr
    assert f"{len(tiny_files['target']) / 1000:.1f} KB freed" in done.stderr
    assert not q8.exists() and q4.read_bytes() == tiny_files["draft"]
    again = _cli(["models", "rm", "hf:tiny/Tiny-GGUF:Q8_0"], hub_env, hub_server.url)
    assert "not cached" in again.stderr
