"""Models from the Hugging Face Hub: `hf:OWNER/REPO[@REVISION][:QUANT | /FILE]`.

Everything goes through `huggingface_hub`'s public API, so its cache (HF_HUB_CACHE, no copies), its
token (HF_TOKEN or `hf auth login`), HF_ENDPOINT and HF_HUB_OFFLINE behave as in every other HF tool:

* `pull(name)` asks the hub for the repo's file list with LFS metadata (`HfApi.model_info(...,
  files_metadata=True)`), picks the GGUF (a quant label, a file, or Q4_K_M by default; every shard of
  a split model), downloads each file with `hf_hub_download` (it resumes a `.incomplete` blob; edgespec
  retries a dropped connection, which resumes where it stopped) and then checks the blob's sha256
  against the hub's LFS sha256. A file that fails is deleted from the cache, blob and snapshot link,
  so nothing is left under the model's name.
* `resolve(name)` uses the cached copy when the revision's snapshot holds the model, else pulls it.
  With HF_HUB_OFFLINE=1 only the cache is read.

Environment variables are read when called (not when huggingface_hub was imported), so a process may
set them late. huggingface_hub's own tqdm bars are replaced by one rich bar on stderr.
"""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import CatalogError, EdgespecError, ModelFileError
from edgespec.models import digests
from edgespec.models.gguf_names import GGUFModel, pick, with_shards
from edgespec.models.progress import progress_bar
from edgespec.models.sources import Pulled, Source

PREFIX = "hf:"
_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[\w.-]+))?(?::(?P<quant>[\w.-]+)|/(?P<file>.+))?")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
ATTEMPTS = 4  # a dropped connection is retried this many times; each retry resumes the .incomplete blob
# What `edgespec export hf:...` needs from a checkpoint repo (weights, config, tokenizer), never *.bin/*.gguf.
CHECKPOINT_FILES = re.compile(r"^([^/]+\.json|[^/]+\.safetensors|[^/]+\.jinja|tokenizer\.model|[^/]+\.tiktoken|"
                              r"merges\.txt|vocab\.txt)$")  # top-level files only: no onnx/, gguf/ copies


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str | None = None
    quant: str | None = None
    file: str | None = None

    @property
    def name(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        tail = f":{self.quant}" if self.quant else (f"/{self.file}" if self.file else "")
        return f"{PREFIX}{self.repo}{rev}{tail}"


def is_hub_name(text: str) -> bool:
    return str(text).startswith(PREFIX)


def parse(text: str) -> HubRef:
    """`hf:OWNER/REPO[@REV][:QUANT|/FILE]` -> HubRef; ModelFileError with the grammar otherwise."""
    m = _SPEC.fullmatch(str(text)[len(PREFIX):]) if is_hub_name(text) else None
    if not m:
        raise ModelFileError(f"{text!r} is not a hub model name; write hf:OWNER/REPO, hf:OWNER/REPO:QUANT "
                             "(e.g. hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0), hf:OWNER/REPO/FILE.gguf, "
                             "with @REVISION after the repo to pin one")
    return HubRef(m["repo"], m["rev"], m["quant"], m["file"])


@dataclass(frozen=True)
class HubSettings:
    endpoint: str
    cache_dir: Path
    offline: bool


def settings() -> HubSettings:
    """HF_ENDPOINT, HF_HUB_CACHE (or HF_HOME/hub) and HF_HUB_OFFLINE as set now, else the library's defaults."""
    from huggingface_hub import constants

    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    cache = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE)
    flag = os.environ.get("HF_HUB_OFFLINE")
    offline = flag.strip().upper() in {"1", "ON", "YES", "TRUE"} if flag is not None else bool(constants.HF_HUB_OFFLINE)
    return HubSettings(endpoint, Path(cache).expanduser(), offline)


def repo_dir(repo: str, hub: HubSettings | None = None) -> Path:
    """The cache folder of a model repo (huggingface_hub's layout: models--OWNER--NAME)."""
    return (hub or settings()).cache_dir / ("models--" + repo.replace("/", "--"))


# --- resolving a name to a file ----------------------------------------------------------------

def resolve(name: str, *, download: bool = True, progress: bool = True) -> Path:
    """The local path of a hub GGUF (its first shard for a split model): the cached copy when the
    revision's snapshot holds it (sha256 checked once), else pulled (unless `download` is False)."""
    ref = parse(name)
    hub = settings()
    cached = _from_cache(ref, hub, progress)
    if cached is not None:
        return cached
    if hub.offline:
        raise ModelFileError(f"HF_HUB_OFFLINE is set and {ref.name} is not in the Hugging Face cache "
                             f"({hub.cache_dir}); pull it where the hub is reachable: "
                             f"`edgespec models pull {ref.name}`")
    if not download:
        raise ModelFileError(f"{ref.name} is not downloaded; run `edgespec models pull {ref.name}`")
    return pull(name, progress=progress)[0]


def pull(name: str, *, progress: bool = True) -> tuple[Path, bool]:
    """Fetch a hub GGUF (every shard) into the HF cache and check each file's sha256 against the hub's
    LFS metadata; return (path of the first file, whether everything was cached already)."""
    ref = parse(name)
    hub = settings()
    if hub.offline:
        cached = _from_cache(ref, hub, progress)
        if cached is None:
            raise ModelFileError(f"HF_HUB_OFFLINE is set and {ref.name} is not in the Hugging Face cache "
                                 f"({hub.cache_dir}); unset HF_HUB_OFFLINE to download it")
        return cached, True
    info = _model_info(ref, hub)
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    model = _choose(ref, list(siblings))
    paths, fetched = _download(ref, hub, info.sha, [siblings[f] for f in model.files], progress)
    return paths[0], not fetched


def snapshot(name: str, *, progress: bool = True) -> Path:
    """A checkpoint repo (safetensors, config, tokenizer) in the HF cache, for `edgespec export`;
    returns its snapshot folder. Each LFS file is sha256-checked like a GGUF."""
    ref = parse(name)
    if ref.quant or ref.file:
        raise EdgespecError(f"{ref.name}: export takes a whole checkpoint repo, hf:OWNER/REPO[@REV]")
    hub = settings()
    if hub.offline:
        snap = _snapshot_dir(ref, hub)
        if snap is None or not any(snap.rglob("*.safetensors")):
            raise ModelFileError(f"HF_HUB_OFFLINE is set and {ref.name} is not in the Hugging Face cache "
                                 f"({hub.cache_dir}); unset HF_HUB_OFFLINE to download it")
        return snap
    info = _model_info(ref, hub)
    wanted = [s for s in (info.siblings or []) if CHECKPOINT_FILES.search(s.rfilename)]
    if not any(s.rfilename.endswith(".safetensors") for s in wanted):
        raise ModelFileError(f"{ref.name} has no safetensors weights; `edgespec export` needs a Hugging Face "
                             "checkpoint (config.json, *.safetensors, tokenizer)")
    paths, _ = _download(ref, hub, info.sha, wanted, progress)
    return _snapshot_root(paths[0], wanted[0].rfilename)


def _snapshot_root(path: Path, rfilename: str) -> Path:
    root = path
    for _ in rfilename.split("/"):
        root = root.parent
    return root


def _choose(ref: HubRef, names: list[str]) -> GGUFModel:
    if ref.file:
        return with_shards(names, ref.file, f"{PREFIX}{ref.repo}")
    return pick(names, ref.quant, f"{PREFIX}{ref.repo}")


# --- the cache ------------------------------------------------------------------------------------

def _snapshot_dir(ref: HubRef, hub: HubSettings) -> Path | None:
    root = repo_dir(ref.repo, hub)
    rev = ref.revision or "main"
    if _COMMIT.fullmatch(rev):
        commit = rev
    else:
        try:
            commit = (root / "refs" / rev).read_text().strip()
        except OSError:
            return None
    snap = root / "snapshots" / commit
    return snap if snap.is_dir() else None


def _from_cache(ref: HubRef, hub: HubSettings, progress: bool) -> Path | None:
    """The cached model for this ref when its snapshot holds every file and each passes its sha256."""
    snap = _snapshot_dir(ref, hub)
    if snap is None:
        return None
    names = [p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()]
    try:
        model = _choose(ref, names)
    except ModelFileError:
        return None  # not (all) cached: the hub decides what exists
    unchecked = [f for f in model.files if _HEX64.fullmatch((snap / f).resolve().name)  # LFS blobs: named by sha256
                 and not digests.is_verified(snap / f, (snap / f).resolve().name)]
    with progress_bar(progress and bool(unchecked)) as bar:  # first use of a file another tool downloaded: hash it once
        for f in unchecked:
            blob = (snap / f).resolve()
            task = bar.add_task(f"{f.rsplit('/', 1)[-1]}: sha256", total=blob.stat().st_size) if bar else None
            _check_or_drop(snap / f, blob.name, ref, advance=(lambda n, t=task: bar.advance(t, n)) if bar else None)
    return snap / model.first


def remove(name: str) -> int:
    """Delete a cached hub GGUF (every shard: blob and snapshot link); return the bytes freed (0: not cached).
    Other files of the repo, and blobs another snapshot still links to, stay."""
    ref = parse(name)
    hub = settings()
    snap = _snapshot_dir(ref, hub)
    if snap is None:
        return 0
    names = [p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()]
    try:
        model = _choose(ref, names)
    except ModelFileError:
        return 0
    root = repo_dir(ref.repo, hub)
    freed = 0
    for f in model.files:
        link = snap / f
        blob = link.resolve()
        others = [p for p in (root / "snapshots").rglob("*") if p.is_symlink() and p != link and p.resolve() == blob]
        if not others:
            freed += blob.stat().st_size
            blob.unlink(missing_ok=True)
        link.unlink(missing_ok=True)
    return freed


def cached_models(hub: HubSettings | None = None) -> list[dict]:
    """GGUF models in the HF cache: [{"name": hf:..., "path", "bytes", "revision"}], from scan_cache_dir."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from edgespec.models.gguf_names import models_in

    hub = hub or settings()
    try:
        info = scan_cache_dir(hub.cache_dir)
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
            files = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
            models = models_in(list(files))
            refs = sorted(rev.refs)
            at = "" if "main" in refs else f"@{refs[0] if refs else rev.commit_hash}"
            quants = [m.quant for m in models]
            for m in models:
                tail = f":{m.quant}" if m.quant and quants.count(m.quant) == 1 else f"/{m.first}"
                found.append({"name": f"{PREFIX}{repo.repo_id}{at}{tail}", "path": rev.snapshot_path / m.first,
                              "bytes": sum(files[f].size_on_disk for f in m.files), "revision": rev.commit_hash})
    return found



class HubSource(Source):
    """`hf:OWNER/REPO[@REV][:QUANT | /FILE]`: GGUFs in the Hugging Face cache, downloaded on first use."""

    label, prefix = "hf", PREFIX

    def resolve(self, name: str, pull_if_missing: bool = True) -> Path:
        return resolve(name, download=pull_if_missing)

    def installed(self) -> list[dict]:
        return cached_models()

    def pull(self, name: str) -> Pulled:
        path, was_cached = pull(name, progress=True)
        return Pulled(name, path, "already cached" if was_cached else "pulled, sha256 verified")

    def remove(self, name: str) -> int:
        return remove(name)


SOURCE = HubSource()

# --- talking to the hub ----------------------------------------------------------------------------

def _model_info(ref: HubRef, hub: HubSettings):
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=hub.endpoint).model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line (or a bug re-raised)
        raise _explain(exc, ref, hub) from None


def _download(ref: HubRef, hub: HubSettings, commit: str | None, siblings: list, progress: bool
              ) -> tuple[list[Path], bool]:
    """hf_hub_download each file (retrying dropped connections), then check its sha256."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    paths, fetched = [], False
    with _quiet_hf_bars(), progress_bar(progress) as bar:
        for sib in siblings:
            sha = sib.lfs.sha256 if sib.lfs else None
            size = sib.lfs.size if sib.lfs else sib.size
            hit = try_to_load_from_cache(ref.repo, sib.rfilename, cache_dir=hub.cache_dir, revision=commit)
            if not isinstance(hit, str):
                fetched = True
            etag = sha or sib.blob_id
            incomplete = repo_dir(ref.repo, hub) / "blobs" / f"{etag}.incomplete"
            task = bar.add_task(sib.rfilename.rsplit("/", 1)[-1], total=size) if bar else None
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    with _watch(bar, task, incomplete):
                        path = Path(hf_hub_download(ref.repo, sib.rfilename, revision=ref.revision,
                                                    cache_dir=hub.cache_dir, endpoint=hub.endpoint))
                    break
                except Exception as exc:  # noqa: BLE001
                    if not _transient(exc) or attempt == ATTEMPTS:
                        raise _explain(exc, ref, hub, sib.rfilename) from None
                    time.sleep(0.5 * attempt)
            short = sib.rfilename.rsplit("/", 1)[-1]
            if bar:  # the same bar again, for the hash
                bar.update(task, completed=0, description=f"{short}: sha256")
            real = path.resolve()
            if size is not None and real.stat().st_size != size:
                _drop(path)
                raise CatalogError(f"{ref.name}: {sib.rfilename} has {real.stat().st_size} bytes, the hub lists "
                                   f"{size}; it was deleted, run the command again")
            if sha:
                _check_or_drop(path, sha, ref, advance=(lambda n, t=task: bar.advance(t, n)) if bar else None)
            if bar:
                bar.update(task, completed=size, description=f"{short}: sha256 ok" if sha else short)
            paths.append(path)
    return paths, fetched


def _check_or_drop(path: Path, sha256: str, ref: HubRef, advance=None) -> None:
    if digests.check(path, sha256, advance):
        return
    _drop(path)
    raise CatalogError(f"{ref.name}: {path.name} failed its sha256 check (the hub lists {sha256[:12]}...); "
                       f"the file was deleted from the cache; run `edgespec models pull {ref.name}` again")


def _drop(path: Path) -> None:
    """Delete a cached file: the blob and the snapshot link naming it."""
    blob = path.resolve()
    blob.unlink(missing_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink(missing_ok=True)


def _transient(exc: BaseException) -> bool:
    """A dropped or failed connection (worth a retry that resumes), not an HTTP answer."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, (HfHubHTTPError, OfflineModeIsEnabled)):
        return False
    kinds: list[type] = [ConnectionError, TimeoutError]
    try:
        import requests

        kinds += [requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError,
                  requests.exceptions.Timeout]
    except ImportError:
        pass
    import httpx

    kinds.append(httpx.TransportError)
    return isinstance(exc, tuple(kinds)) or (isinstance(exc, OSError) and "Consistency check failed" in str(exc))


def _explain(exc: BaseException, ref: HubRef, hub: HubSettings, file: str | None = None) -> Exception:
    """One line saying what went wrong with the hub and what to do; a bug stays a bug (returned as is)."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{PREFIX}{ref.repo}"
    login = "set HF_TOKEN or run `hf auth login`"
    if isinstance(exc, GatedRepoError):
        if get_token():
            return CatalogError(f"{where} is gated and your token has no access yet: accept its terms on "
                                f"{hub.endpoint}/{ref.repo} with the account of your token, then run again")
        return CatalogError(f"{where} is gated: accept its terms on {hub.endpoint}/{ref.repo}, then {login}")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelFileError(f"no model repository {ref.repo} on {hub.endpoint} (check the name; if it is "
                              f"private, {login})")
    if isinstance(exc, RevisionNotFoundError):
        return ModelFileError(f"{where} has no revision {ref.revision!r}; give a branch, tag or commit it has")
    if isinstance(exc, LocalEntryNotFoundError) or isinstance(exc, OfflineModeIsEnabled):
        return ModelFileError(f"cannot reach the hub at {hub.endpoint} and {ref.name} is not cached; check the "
                              "network (or HF_ENDPOINT), or run offline (HF_HUB_OFFLINE=1) with a cached model")
    if isinstance(exc, EntryNotFoundError):
        return ModelFileError(f"{where} has no file {file or ref.file}")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        return CatalogError(f"the hub at {hub.endpoint} answered HTTP {status} for {ref.name}; try again later")
    if _transient(exc):
        what = f"downloading {file}" if file else "asking for the file list"
        return CatalogError(f"cannot reach the hub at {hub.endpoint} ({what} of {ref.name}: "
                            f"{type(exc).__name__}); check the network (or HF_ENDPOINT) and run the command again "
                            "(a download resumes where it stopped), or run offline (HF_HUB_OFFLINE=1) with a "
                            "cached model")
    return exc


# --- progress ------------------------------------------------------------------------------------

@contextmanager
def _quiet_hf_bars():
    """huggingface_hub's tqdm bars off while ours runs (its global switch, restored after)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was:
            enable_progress_bars()


@contextmanager
def _watch(bar, task, incomplete: Path, every_s: float = 0.1):
    """Move the bar with the size of the `.incomplete` blob hf_hub_download writes (a resumed download
    starts where the last one stopped)."""
    if bar is None:
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every_s):
            try:
                bar.update(task, completed=incomplete.stat().st_size)
            except OSError:
                pass

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
