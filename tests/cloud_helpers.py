"""A real `edgespec serve --verifier` process on 127.0.0.1 for the cloud tests: start, kill, restart."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key-0123456789"
OTHER_KEY = "other-key-9876543210"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VerifierProcess:
    """`python -m edgespec.cli serve --verifier ...` as a subprocess; `url` once it answers /v1/health."""

    def __init__(self, target: Path | str, *, port: int | None = None, keys=(API_KEY, OTHER_KEY),
                 max_sessions: int = 10, session_ctx: int = 512, extra: tuple[str, ...] = (), threads: int = 1,
                 certfile: str | None = None, keyfile: str | None = None, log_dir: Path | None = None):
        self.target = str(target)
        self.port = port or free_port()
        self.keys = keys
        self.args = ["--max-sessions", str(max_sessions), "--session-ctx", str(session_ctx),
                     "--threads", str(threads), *extra]
        self.tls = (certfile, keyfile) if certfile else None
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "VerifierProcess":
        cmd = [sys.executable, "-m", "edgespec.cli", "serve", "--verifier", "--target", self.target, "--port", str(self.port),
               *[a for k in self.keys for a in ("--api-key", k)], *self.args]
        if self.tls:
            cmd += ["--ssl-certfile", self.tls[0], "--ssl-keyfile", self.tls[1]]
        self.starts += 1
        log = open(self.log_dir / f"verifier-{self.port}-{self.starts}.log", "wb") if self.log_dir else subprocess.DEVNULL
        env = {k: v for k, v in os.environ.items() if k != "EDGESPEC_API_KEY"}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        verify = ssl.create_default_context(cafile=self.tls[0]) if self.tls else True
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the verifier exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=1.0, verify=verify, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError("the verifier did not start in time")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> "VerifierProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
