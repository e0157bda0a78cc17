"""Scale-out on Ray Serve: the cloud verifier (and the OpenAI server) as a Ray Serve application.

    HTTP -> Ray Serve proxy -> VerifierIngress (stateless) -> SessionAffinityRouter -> VerifierReplica x N

Each `VerifierReplica` is one engine: a `VerifierCore` (one model, its sessions in one llama.cpp
KV pool, the worker thread that batches their verifications) behind the same FastAPI app a single
`serve --verifier` process runs, called in-process (httpx's ASGI transport), so authentication,
validation, limits and error codes are the ones of docs/cloud_protocol.md, byte for byte.

Session affinity: a replica names its sessions `<replica id>.<random>`, so the router sends a
session's requests to the replica that holds its KV without any shared table, and new sessions
(and sessions whose replica is gone) to the replica with the fewest sessions, then the shortest
queue. Correctness never depends on it: a replica that does not hold a session answers 404, and a
request whose replica died while it was in flight is answered 404 by the ingress, and the client
rebuilds the session from the tokens it holds (the offline-resume path); a session start is
retried on another replica. Ray is imported only here: `pip install 'edgespec[ray]'`.

The OpenAI server needs no affinity (every request carries its whole prompt; each replica keeps its
own prefix cache), so its replicas are the HTTP ingress themselves, behind Ray Serve's default
router (power of two choices on ongoing requests).

Memory: every replica loads its own model (weights mmap'ed, shared by replicas on one node through
the page cache) and its own KV pool (--max-sessions x --session-ctx cells) in a Ray worker; Ray's
own processes (ingress, proxy, controller, raylet, GCS, agents) took about 600 MB of unique memory
on the build machine, a SmolLM2 replica 201 MB (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from fastapi import FastAPI, Request  # module level: the routes' annotations are resolved from here
from fastapi.responses import Response

from edgespec.errors import EdgespecError

try:
    import ray
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError as exc:  # the optional extra is missing
    raise EdgespecError(f"--ray needs Ray Serve ({exc.name} is not installed): pip install 'edgespec[ray]'") from None

VERIFIER_APP = "edgespec-verifier"
OPENAI_APP = "edgespec-openai"
REPLICA_DEPLOYMENT = "VerifierReplica"
START_ATTEMPTS = 3            # a session start whose replica died is retried on another
CALL_TIMEOUT_S = 120.0        # a start includes the prompt's prefill; a verify may wait for its turn


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None                 # None: start a local Ray instance for this command
    replicas: int = 1
    autoscale: tuple[int, int] | None = None   # (min, max) replicas; Ray Serve scales on ongoing requests
    cpus_per_replica: float = 1.0              # Ray's logical CPUs a replica reserves (give it --threads)
    object_store_mb: int = 100                 # local instance: nothing large travels through it
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.autoscale is None and not 1 <= self.replicas <= 1024:
            raise EdgespecError(f"--replicas must be between 1 and 1024, got {self.replicas}")
        if self.autoscale is not None:
            lo, hi = self.autoscale
            if not 0 <= lo <= hi or hi < 1:
                raise EdgespecError(f"--autoscale MIN,MAX needs 0 <= MIN <= MAX and MAX >= 1, got {lo},{hi}")

    @property
    def max_replicas(self) -> int:
        return self.autoscale[1] if self.autoscale else self.replicas

    def scaling(self, target_ongoing_requests: int) -> dict:
        if self.autoscale is None:
            return {"num_replicas": self.replicas}
        lo, hi = self.autoscale
        return {"autoscaling_config": {"min_replicas": lo, "initial_replicas": max(lo, 1), "max_replicas": hi,
                                       "target_ongoing_requests": target_ongoing_requests}}


def parse_autoscale(value: str) -> tuple[int, int]:
    """'MIN,MAX' to a pair of ints, or one clear error."""
    try:
        lo, hi = (int(part) for part in value.split(","))
    except ValueError:
        raise EdgespecError(f"--autoscale takes MIN,MAX (two integers, e.g. 1,4), got {value!r}") from None
    return lo, hi


# --- connecting --------------------------------------------------------------------------------

def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast with one line on an address nothing listens at (ray.init would retry for a minute)."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise EdgespecError(f"--ray-address must be HOST:PORT (the head's GCS port, 6379 by default), "
                            f"ray://HOST:PORT or auto, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise EdgespecError(f"cannot reach the Ray cluster at {address} ({reason}); start it with `ray start "
                            "--head` there, fix --ray-address, or drop it to run a local Ray instance") from None


def connect(options: RayOptions) -> bool:
    """Join the cluster at `options.address`, or start a small local instance. True when this process
    started Ray (and so shuts it down at the end)."""
    import logging

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    if not options.verbose:  # the C++ core repeats each failed GCS call on stderr otherwise
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
    if not options.verbose:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    if ray.is_initialized():
        return False
    quiet = dict(log_to_driver=options.verbose, logging_level=logging.INFO if options.verbose else logging.WARNING,
                 configure_logging=True)
    if options.address:
        check_reachable(options.address)
        try:
            ray.init(address=options.address, **quiet)
        except Exception as exc:  # ConnectionError, RuntimeError, version mismatches...
            raise EdgespecError(f"cannot join the Ray cluster at {options.address}: {_first_line(exc)}") from None
        return False
    # A local instance is for this machine: its node address is loopback (Ray's own services still
    # listen on every interface, guarded by its token authentication: docs/scale-out.md).
    ray.init(num_cpus=max(1, int(round(options.max_replicas * options.cpus_per_replica))),
             object_store_memory=options.object_store_mb << 20, include_dashboard=False,
             _node_ip_address="127.0.0.1", **quiet)
    return True


def gcs_address() -> str:
    return ray.get_runtime_context().gcs_address


# --- routing ---------------------------------------------------------------------------------------

def replica_of(session_id: str | None) -> str | None:
    """The replica id a session id starts with (`<replica>.<random>`), or None."""
    if not session_id or "." not in session_id:
        return None
    return session_id.split(".", 1)[0]


class SessionAffinityRouter(RequestRouter):
    """A session's requests go to the replica that holds it; anything else to the least loaded.

    The route is the `route` argument of `VerifierReplica.forward` (the replica id taken from the
    session id). Least loaded: fewest sessions, as each replica reports them every second plus
    the starts this router has sent it since that report (a burst of starts arrives faster than
    reports), then the fewest requests in flight.
    """

    def initialize_state(self, **kwargs) -> None:
        self._placed: dict[str, tuple[Any, int]] = {}  # replica id -> (the report counted from, starts sent since)
        self._chosen: dict[Any, str] = {}  # start request id -> replica counted for it, until Ray routes it

    def _placed_since_report(self, replica: RunningReplica) -> int:
        report = (replica.routing_stats or {}).get("reported_at")
        seen, placed = self._placed.get(replica.replica_id.unique_id, (report, 0))
        if seen != report:  # a newer report counts them already
            placed = 0
        self._placed[replica.replica_id.unique_id] = (report, placed)
        return placed

    def _count(self, replica_id: str, n: int) -> None:
        report, placed = self._placed.get(replica_id, (None, 0))
        self._placed[replica_id] = (report, max(0, placed + n))

    def _load(self, replica: RunningReplica) -> tuple[int, int]:
        sessions = int((replica.routing_stats or {}).get("sessions", 0)) + self._placed_since_report(replica)
        return sessions, self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        route = kwargs.get("route")
        if route:
            holder = [r for r in candidate_replicas if r.replica_id.unique_id == route]
            if holder:  # wait for it when it is busy rather than force a rebuild elsewhere
                return [holder]
        if not candidate_replicas:
            return []
        if kwargs.get("opens_session"):  # counted now, so that the next start of a burst sees it
            request_id = pending_request.metadata.internal_request_id or id(pending_request)
            if request_id in self._chosen:  # chosen again after a backoff: forget the first count
                self._count(self._chosen.pop(request_id), -1)
            ranked = sorted(candidate_replicas, key=self._load)
            self._count(ranked[0].replica_id.unique_id, +1)
            if len(self._chosen) > 10_000:  # requests that were never routed (cancelled)
                self._chosen.clear()
            self._chosen[request_id] = ranked[0].replica_id.unique_id
        else:
            ranked = sorted(candidate_replicas, key=self._load)
        return [ranked[:1], ranked[1:]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """A start may land elsewhere than the first choice (a replica whose queue-length probe times out
        on a loaded machine is passed over): move its count there. Ray calls this where it enforces
        max_ongoing_requests, its default outside Ray Client."""
        if not pending_request.kwargs.get("opens_session"):
            return
        chosen = self._chosen.pop(pending_request.metadata.internal_request_id or id(pending_request), None)
        if chosen != replica_id.unique_id:
            if chosen is not None:
                self._count(chosen, -1)
            self._count(replica_id.unique_id, +1)


# --- the verifier's deployments ----------------------------------------------------------------------

class VerifierReplica:
    """One engine: a VerifierCore and the protocol's FastAPI app, called in-process."""

    def __init__(self, target: str, config, load_options: dict):
        import httpx

        from edgespec.cloud.verifier import create_app, load_core

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.core = load_core(target, replace(config, session_id_prefix=f"{self.replica_id}."), **load_options)
        self.app = create_app(self.core)
        self._httpx = httpx

    async def forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes, client: str,
                      route: str | None = None, opens_session: bool = False) -> tuple[int, str, bytes, str]:
        """One HTTP request through the replica's app: (status, content type, body, replica id).
        `route` and `opens_session` are for the router."""
        transport = self._httpx.ASGITransport(app=self.app, client=(client, 0))
        request = self._httpx.Request(method, f"http://replica{path}", headers=headers, content=body)
        response = await transport.handle_async_request(request)
        data = await response.aread()
        return response.status_code, response.headers.get("content-type", ""), data, self.replica_id

    def record_routing_stats(self) -> dict[str, Any]:
        return {"sessions": len(self.core.sessions), "reported_at": time.monotonic()}

    def check_health(self) -> None:
        if not self.core._thread.is_alive():  # the worker that owns the model has died: let Ray replace us
            raise RuntimeError("the verifier's worker thread is not running")

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.stop()
            core.runtime.close()


class VerifierIngress:
    """Stateless HTTP front: reads the session id (path, or `resume` of a start) and forwards."""

    def __init__(self, replicas, max_body_bytes: int):
        self.replicas = replicas
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        from edgespec.cloud.protocol import CONTENT_TYPE, error_message, pack

        app = FastAPI(title="edgespec verifier (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)

        def error(status: int, code: str, message: str) -> Response:
            return Response(pack(error_message(code, message)), status_code=status, media_type=CONTENT_TYPE)

        @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def forward(path: str, request: Request):
            body = bytearray()
            async for chunk in request.stream():  # the replica refuses an oversized body; read no more than that
                body += chunk
                if len(body) > self.max_body_bytes:
                    break
            body = bytes(body)
            headers = [(k, v) for k, v in request.headers.items() if k in ("authorization", "content-type")]
            route, is_start = self._route(request.method, "/" + path, body)
            client = request.client.host if request.client else "?"
            for attempt in range(START_ATTEMPTS if is_start or request.method == "GET" else 1):
                try:
                    status, ctype, data, replica = await asyncio.wait_for(
                        self.replicas.forward.remote(request.method, "/" + path, headers, body, client, route=route,
                                                    opens_session=is_start),
                        CALL_TIMEOUT_S)
                except RayActorError:  # the replica died (killed, scaled down, its node lost) under the request
                    if is_start or request.method == "GET":
                        await asyncio.sleep(0.2 * (attempt + 1))
                        route = None
                        continue
                    return error(404, "unknown_session", "the replica that held this session is gone: start it "
                                                         "again from your token history")
                except asyncio.TimeoutError:
                    return error(503, "overloaded", f"no verifier replica answered within {CALL_TIMEOUT_S:g} s")
                except Exception as exc:  # BackPressureError and the like: overloaded, try later
                    return error(503, "overloaded", f"the verifier replicas cannot take this request "
                                                    f"({type(exc).__name__})")
                return Response(data, status_code=status, media_type=ctype or None,
                                headers={"x-edgespec-replica": replica})
            return error(503, "overloaded", "no verifier replica is available; retry later")

        return app

    @staticmethod
    def _route(method: str, path: str, body: bytes) -> tuple[str | None, bool]:
        """(replica to route to, whether this is a session start)."""
        parts = path.strip("/").split("/")
        if method == "POST" and parts == ["v1", "sessions"]:
            import msgpack

            try:
                message = msgpack.unpackb(body, raw=False, max_bin_len=len(body), max_str_len=256)
                resume = message.get("resume") if isinstance(message, dict) else None
            except Exception:  # the replica answers what is wrong with it
                resume = None
            return replica_of(resume if isinstance(resume, str) else None), True
        if len(parts) >= 3 and parts[:2] == ["v1", "sessions"]:
            return replica_of(parts[2]), False
        return None, False


def verifier_app(target: str, config, load_options: dict, options: RayOptions):
    """The Ray Serve application: the ingress bound to the replicas."""
    from ray.serve.config import RequestRouterConfig

    # Requests that wait inside a replica for an earlier block of their session hold a slot: leave
    # room for every session's blocks in flight, or the block they wait for could not get in.
    per_replica = config.max_sessions * (config.max_waiting + 2)
    replica = serve.deployment(VerifierReplica, name=REPLICA_DEPLOYMENT,
                               ray_actor_options={"num_cpus": options.cpus_per_replica},
                               max_ongoing_requests=per_replica, health_check_period_s=5,
                               request_router_config=RequestRouterConfig(
                                   request_router_class=SessionAffinityRouter,
                                   request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0),
                               **options.scaling(target_ongoing_requests=max(2, per_replica // 4)))
    ingress = serve.deployment(serve.ingress()(VerifierIngress), name="VerifierIngress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(target, config, load_options), config.max_body_bytes)


# --- the OpenAI server's deployment ---------------------------------------------------------------

class OpenAIReplica:
    """One engine behind the OpenAI server's FastAPI app; Ray Serve's proxy is its HTTP front."""

    def __init__(self, load_engine: Callable[[], Any], config):
        self.engine = load_engine()
        self.config = config

    def __serve_build_asgi_app__(self):
        from edgespec.serve.server import create_app

        return create_app(self.engine, self.config)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def openai_app(load_engine: Callable[[], Any], config, options: RayOptions):
    # The app's own queue answers 429 past max_queue; Ray must not hold requests back before it does.
    replica = serve.deployment(serve.ingress()(OpenAIReplica), name="OpenAIReplica",
                               ray_actor_options={"num_cpus": options.cpus_per_replica},
                               max_ongoing_requests=config.max_queue + 1,
                               **options.scaling(target_ongoing_requests=1))
    return replica.bind(load_engine, config)


# --- running -------------------------------------------------------------------------------------------

@dataclass
class RayDeployment:
    """An application running on Ray Serve; `url` is where its HTTP proxy listens."""

    app_name: str
    url: str
    started_ray: bool

    def replica_ids(self, deployment: str = REPLICA_DEPLOYMENT) -> list[str]:
        """Running replicas of a deployment, by Ray Serve replica id (what session ids start with)."""
        prefix = f"SERVE_REPLICA::{self.app_name}#{deployment}#"
        return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(prefix))

    def replica_actor(self, replica_id: str, deployment: str = REPLICA_DEPLOYMENT):
        return ray.get_actor(f"SERVE_REPLICA::{self.app_name}#{deployment}#{replica_id}", namespace="serve")

    def shutdown(self) -> None:
        """Delete the application; stop Ray too when this process started it."""
        try:
            serve.delete(self.app_name)
        except Exception:
            pass
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()


def deploy(app_name: str, application, options: RayOptions, *, host: str, port: int,
           ssl_certfile: str | None = None, ssl_keyfile: str | None = None) -> RayDeployment:
    """Start (or join) Ray, start Serve's HTTP proxy on host:port, run the application, wait until ready."""
    started = connect(options)
    _stop_on_sigterm()  # after ray.init, whose own handler would abort the process without cleaning up
    try:
        http = {"host": host.strip("[]"), "port": port}
        if ssl_certfile:
            http.update(ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
        serve.start(http_options=http, logging_config={"log_level": "INFO" if options.verbose else "WARNING"})
        serve.run(application, name=app_name, route_prefix="/")
        listening = _proxy_port()
        if listening is not None and listening != port:
            raise EdgespecError(f"Ray Serve on this cluster already listens on port {listening}; give --port "
                                f"{listening} (one HTTP port per cluster)")
    except BaseException as exc:
        if started:
            serve.shutdown()
            ray.shutdown()
        if isinstance(exc, (EdgespecError, KeyboardInterrupt)):
            raise
        raise EdgespecError(f"Ray Serve could not deploy {app_name}: {_first_line(exc)}") from None
    shown = f"[{host}]" if ":" in host else host
    return RayDeployment(app_name, f"{'https' if ssl_certfile else 'http'}://{shown}:{port}", started)


def _proxy_port() -> int | None:
    """The HTTP port Serve's proxies use on this cluster (set by whoever started Serve first)."""
    try:
        from ray.serve.context import _get_global_client

        return int(_get_global_client().http_config.port)
    except Exception:  # an internal API: when it moves, skip the check rather than fail
        return None


class _Stopped(KeyboardInterrupt):
    """SIGTERM: stop as Ctrl-C does."""


def _stop_on_sigterm() -> None:
    import signal
    import threading

    def on_sigterm(signum, frame):
        raise _Stopped()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def serve_until_stopped(deployment: RayDeployment, banner: str) -> None:
    """The foreground of `edgespec serve --ray`: print, wait for Ctrl-C or SIGTERM, then clean up."""
    print(banner, file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM
        pass
    finally:
        deployment.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _where(deployment: RayDeployment, options: RayOptions) -> str:
    scale = (f"autoscaling {options.autoscale[0]}..{options.autoscale[1]} replicas" if options.autoscale
             else f"{options.replicas} replica{'s' * (options.replicas != 1)}")
    cluster = "a local Ray instance" if deployment.started_ray else f"the Ray cluster at {options.address}"
    return f"{scale} on {cluster} (GCS {gcs_address()})"


def serve_verifier(target: str, config, options: RayOptions, *, host: str, port: int,
                   ssl_certfile: str | None = None, ssl_keyfile: str | None = None, **load_options) -> None:
    """`edgespec serve --verifier --ray`."""
    deployment = deploy(VERIFIER_APP, verifier_app(target, config, load_options, options), options, host=host,
                        port=port, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
    serve_until_stopped(deployment, f"edgespec serve --verifier --ray: {target} on {deployment.url}, "
                                    f"{_where(deployment, options)}, each {config.max_sessions} sessions x "
                                    f"{config.max_context} tokens")


def serve_openai(load_engine: Callable[[], Any], config, options: RayOptions, *, host: str, port: int,
                 ssl_certfile: str | None = None, ssl_keyfile: str | None = None) -> None:
    """`edgespec serve --ray` (the OpenAI API)."""
    deployment = deploy(OPENAI_APP, openai_app(load_engine, config, options), options, host=host, port=port,
                        ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
    serve_until_stopped(deployment, f"edgespec serve --ray: {deployment.url}/v1 serving {config.model_id!r}, "
                                    f"{_where(deployment, options)}")
