"""A loopback HTTP server shaped like the Hugging Face Hub's file API, for the real huggingface_hub client.

It answers what `HfApi.model_info(files_metadata=True)` and `hf_hub_download` ask (huggingface_hub
0.36, file_download.py / hf_api.py):

* `GET /api/models/{repo}[/revision/{rev}]?blobs=true`: `id`, `sha` (the commit), `siblings` with
  `rfilename`, `size`, `blobId` and `lfs` {sha256, size, pointerSize};
* `HEAD /{repo}/resolve/{rev}/{file}`: `X-Repo-Commit`, `ETag` and `X-Linked-Etag` (the sha256 for LFS
  files), `X-Linked-Size`, `Content-Length`;
* `GET` of the same URL, with `Range: bytes=N-` for a resumed download (206 + Content-Range);
* errors as the hub sends them: 404 + `X-Error-Code: RepoNotFound` / `RevisionNotFound` /
  `EntryNotFound`, and 401 (no token) or 403 (a token without access) + `X-Error-Code: GatedRepo`.

Faults for tests: `drop_once[(repo, file)] = N` sends the full Content-Length but closes the connection
after N bytes, once; `corrupt.add((repo, file))` serves bytes that differ from the listed sha256.
Every request is logged in `requests` as (method, path, Range header, Authorization header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    """A model repo: ref name -> {file name: bytes}; `gated` repos need the token `token`."""

    refs: dict[str, dict[str, bytes]]
    gated: bool = False
    token: str = "hf_test_token"

    def commit(self, ref: str) -> str | None:
        if ref in self.refs:
            return hashlib.sha1(ref.encode()).hexdigest()
        for name in self.refs:  # a commit hash given as the revision
            if hashlib.sha1(name.encode()).hexdigest() == ref:
                return ref
        return None

    def files_at(self, ref: str) -> dict[str, bytes] | None:
        commit = self.commit(ref)
        for name, files in self.refs.items():
            if hashlib.sha1(name.encode()).hexdigest() == commit:
                return files
        return None


def lfs_sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop_once: dict[tuple[str, str], int] = field(default_factory=dict)
    corrupt: set[tuple[str, str]] = field(default_factory=set)
    requests: list[tuple[str, str, str | None, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def is_lfs(name: str) -> bool:
    return name.endswith((".gguf", ".safetensors"))


class _Handler(BaseHTTPRequestHandler):
    state: HubState  # set on the subclass per server

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    # --- routing --------------------------------------------------------------------------------
    def _serve(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        with self.state.lock:
            self.state.requests.append((self.command, path, self.headers.get("Range"),
                                        self.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = "/".join(parts[2:4])
            rev = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
            return self._info(repo_id, rev)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            return self._file(repo_id, rev, file, head)
        self._error(404, "EntryNotFound", "no such route")

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _access(self, repo_id: str) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated:
            auth = self.headers.get("Authorization") or ""
            if auth != f"Bearer {repo.token}":
                status = 403 if auth else 401
                self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                            "to it and be authenticated to access it. Please log in.")
                return None
        return repo

    def _info(self, repo_id: str, rev: str) -> None:
        repo = self._access(repo_id)
        if repo is None:
            return
        files = repo.files_at(rev)
        if files is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        siblings = []
        for name, data in sorted(files.items()):
            sib = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if is_lfs(name):
                sib["lfs"] = {"sha256": lfs_sha(data), "size": len(data), "pointerSize": 134}
            siblings.append(sib)
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit(rev), "private": False,
                           "gated": "manual" if repo.gated else False, "siblings": siblings}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _file(self, repo_id: str, rev: str, file: str, head: bool) -> None:
        repo = self._access(repo_id)
        if repo is None:
            return
        files = repo.files_at(rev)
        if files is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if file not in files:
            return self._error(404, "EntryNotFound", f"{file} does not exist on {rev}")
        data = files[file]
        etag = lfs_sha(data) if is_lfs(file) else git_blob_id(data)
        key = (repo_id, file)
        if key in self.state.corrupt:
            data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and not head:
            start = int(rng[len("bytes="):].split("-", 1)[0] or 0)
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit(rev))
        self.send_header("ETag", f'"{etag}"')
        if is_lfs(file):
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        with self.state.lock:
            cut = self.state.drop_once.pop(key, None)
        if cut is not None and cut > start:
            self.wfile.write(body[: cut - start])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


class HubServer:
    """`with HubServer() as hub:` serves `hub.state` on http://127.0.0.1:PORT (`hub.url`)."""

    def __init__(self) -> None:
        self.state = HubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, repo_id: str, files: dict[str, bytes], *, gated: bool = False,
            refs: dict[str, dict[str, bytes]] | None = None) -> Repo:
        repo = Repo({"main": files, **(refs or {})}, gated=gated)
        self.state.repos[repo_id] = repo
        return repo

    def gets(self, file: str) -> list[tuple[str, str | None]]:
        """(method, Range) of every request for a file's resolve URL."""
        return [(m, r) for m, p, r, _ in self.state.requests if "/resolve/" in p and p.endswith("/" + file)]

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
