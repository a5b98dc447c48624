"""Serval on Ray Serve: each Serval replica a Ray Serve replica, routed by Serval's own policy.

- ``ServalReplica`` (one deployment per model): a replica actor that runs a `serval serve` process on a loopback
  port (the engine core in its own process, as always) and hands requests to it, passing the answer through as it
  streams. Ray Serve health-checks it (the server's /health) and restarts it when it dies; the `serval serve`
  process dies with its actor (PR_SET_PDEATHSIG), so a killed replica leaves no engine behind.
- ``ServalRequestRouter``: Ray Serve's request routing for those deployments, driven by cluster/policy.py (the same
  cache-aware or least-outstanding policy as `serval router`): it reads the prompt from the request's arguments,
  counts each replica's requests in flight, and ranks the policy's pick first and the rest by load.
- ``ServalIngress``: the OpenAI-compatible HTTP front (FastAPI under Ray Serve's proxy): API keys, the variant
  rules, the model's deployment, and retries. A request that never started on a replica (its actor died before
  answering, or its server answered 503) goes to another one; once a stream has sent bytes to the client, a replica
  that dies ends it with an SSE error event, never silently.
- Autoscaling is Ray Serve's, on ongoing requests per replica (``target_ongoing_requests``).

`serval ray-serve` starts a local Ray instance (or joins ``--address``) and runs the application.
"""

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import zlib

import httpx
import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serval.cluster.config import RayServeConfig
from serval.cluster.policy import Replica, VariantRules, make_policy, prompt_text
from serval.cluster.proxy import error_response, sse_error
from serval.lifetime import ending_with_parent

logger = logging.getLogger("serval.ray_serve")
PASSED_HEADERS = ("content-type", "retry-after", "x-serval-dropped-messages", "cache-control")
# What a replica that died before answering raises at the caller: the request may go to another replica.
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class ServalReplica:
    """A Ray Serve replica: one `serval serve` process, and the calls that reach it."""

    def __init__(self, serve_args: list[str], threads: int | None = None, start_timeout: float = 300.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        env = {**os.environ, "SERVAL_REPLICA_ID": self.replica_id}  # names the engine's process in `ps e`
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen([sys.executable, "-m", "serval.cli", "serve", "--port", str(self.port),
                                      *serve_args], env=env,
                                     preexec_fn=ending_with_parent(signal.SIGTERM))  # it ends with this actor
        deadline = time.monotonic() + start_timeout
        while True:  # Ray Serve counts the replica as starting until this returns
            if self.proc.poll() is not None:
                raise RuntimeError(f"serval serve exited with {self.proc.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"serval serve not healthy after {start_timeout} s")
            time.sleep(0.5)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(600.0, connect=5.0),
                                        limits=httpx.Limits(max_connections=None))

    async def check_health(self) -> None:
        """Ray Serve's health check: the replica is replaced when this raises."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"serval serve exited with {self.proc.returncode}")
        response = await self.client.get("/health", timeout=5.0)
        if response.status_code != 200:
            raise RuntimeError(f"serval serve /health answered {response.status_code}")

    async def info(self) -> dict:
        return {"replica": self.replica_id, "actor_pid": os.getpid(), "serve_pid": self.proc.pid, "url": self.url}

    async def models(self) -> dict:
        return (await self.client.get("/v1/models")).json()

    async def generate(self, path: str, payload: dict, headers: dict[str, str], exclude: tuple[str, ...] = ()):
        """Streams the server's answer: first (replica id, status, headers), then the body's bytes as they come.
        ``exclude`` is for the router (replicas that already refused this request), not used here."""
        request = self.client.build_request("POST", path, json=payload, headers=headers)
        response = await self.client.send(request, stream=True)
        try:
            passed = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}  # (Ray's proxy
            # sets its own x-request-id: the client's reaches the server, the server's stays in its log)
            yield self.replica_id, response.status_code, passed
            async for chunk in response.aiter_raw():
                yield chunk
        finally:  # finished, or the caller went away (the server then sees the disconnect and frees the KV)
            await response.aclose()

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


class ServalRequestRouter(RequestRouter):
    """Ray Serve request routing by a Serval policy. Lives in each handle's process (the ingress): what it knows of a
    replica (requests in flight, the prefixes it was sent) is what this process sent it."""

    def initialize_state(self, policy: str = "cache_aware", **_) -> None:
        self.policy = make_policy(policy)
        self.views: dict[ReplicaID, Replica] = {}
        self.routed: dict[str, ReplicaID] = {}  # internal request id -> where it went

    def _view(self, replica: RunningReplica) -> Replica:
        view = self.views.get(replica.replica_id)
        if view is None:
            view = self.views[replica.replica_id] = Replica(replica.replica_id.unique_id)
        return view

    @staticmethod
    def _prompt(pending_request: PendingRequest | None) -> str:
        if pending_request is None or len(pending_request.args) < 2 or not isinstance(pending_request.args[1], dict):
            return ""
        return prompt_text(pending_request.args[1])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        excluded = set(pending_request.kwargs.get("exclude", ())) if pending_request is not None else set()
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in excluded] or candidate_replicas
        if not candidates:
            return []
        by_view = {id(self._view(r)): r for r in candidates}
        # Ray Serve may ask again for the same request: ties go by the request, not by turn.
        tie_break = zlib.crc32(pending_request.metadata.internal_request_id.encode()) \
            if pending_request is not None else None
        decision = self.policy.choose(self._prompt(pending_request), [self._view(r) for r in candidates], tie_break)
        first = by_view[id(decision.replica)]
        if pending_request is not None:
            logger.info("ray serve route %s -> %s (%s: %s)", pending_request.metadata.request_id,
                        first.replica_id.unique_id, self.policy.name, decision.reason)
        rest = sorted((r for r in candidates if r is not first), key=lambda r: self._view(r).outstanding)
        return [[first], rest] if rest else [[first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        view = self.views.get(replica_id)
        if view is None:
            return
        view.outstanding += 1
        self.routed[pending_request.metadata.internal_request_id] = replica_id
        self.policy.routed(self._prompt(pending_request), view)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.routed.pop(internal_request_id, None) is not None and replica_id in self.views:
            self.views[replica_id].outstanding = max(0, self.views[replica_id].outstanding - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.views.pop(replica_id, None)


fastapi_app = FastAPI(title="Serval on Ray Serve")


@serve.ingress(fastapi_app)
class ServalIngress:
    """The HTTP front: picks the model's deployment and retries requests that never started."""

    def __init__(self, replicas: dict, rules: VariantRules | None, api_keys: list[str], max_attempts: int) -> None:
        self.replicas = replicas  # model name -> DeploymentHandle of its ServalReplica deployment
        self.rules = rules
        self.api_keys = api_keys
        self.max_attempts = max_attempts
        self.counts = {"retried_requests": 0, "failed_streams": 0}  # never started, sent again; cut mid-stream

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        return not self.api_keys or header.removeprefix("Bearer ").strip() in self.api_keys

    @fastapi_app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "models": sorted(self.replicas)}

    @fastapi_app.get("/router/state")
    async def state(self) -> dict:
        return {"models": sorted(self.replicas), **self.counts}

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        if not self._authorized(request):
            return error_response("invalid or missing API key (send Authorization: Bearer KEY)", 401,
                                  "invalid_api_key")
        listed = await asyncio.gather(*(handle.models.remote() for handle in self.replicas.values()))
        return {"object": "list", "data": [m for answer in listed for m in answer.get("data", [])]}

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._route(request, "/v1/completions")

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._route(request, "/v1/chat/completions")

    @fastapi_app.post("/v1/responses")
    async def responses(self, request: Request):
        return await self._route(request, "/v1/responses")

    async def _route(self, request: Request, path: str) -> Response:
        """``path``: the server's own endpoint (the request's may carry the application's route prefix)."""
        if not self._authorized(request):
            return error_response("invalid or missing API key (send Authorization: Bearer KEY)", 401,
                                  "invalid_api_key")
        try:
            payload = json.loads(await request.body())
            if not isinstance(payload, dict):
                raise ValueError("not an object")
        except ValueError:
            return error_response("the request body is not a JSON object", 400, "invalid_json")
        model = payload.get("model")
        if self.rules is not None:
            model, _ = self.rules.resolve(model, {k.lower(): v for k, v in request.headers.items()},
                                          prompt_text(payload))
            payload["model"] = model
        handle = self.replicas.get(model) or (next(iter(self.replicas.values())) if len(self.replicas) == 1 else None)
        if handle is None:
            served = ", ".join(sorted(self.replicas))
            return error_response(f"the model {model!r} is not served here (served: {served})", 404,
                                  "model_not_found")
        headers = {"content-type": "application/json"}
        if "x-request-id" in request.headers:
            headers["x-request-id"] = request.headers["x-request-id"]
        refused: list[str] = []
        for attempt in range(self.max_attempts):
            stream = handle.options(stream=True).generate.remote(path, payload, headers,
                                                                 exclude=tuple(refused))
            try:
                replica_id, status, passed = await stream.__anext__()
                # The first bytes too: until the client has some, a replica that dies leaves nothing half-sent.
                first = await stream.__anext__() if status != 503 else b""
            except StopAsyncIteration:
                first = b""
            except REPLICA_GONE as exc:
                logger.warning("request to %s: replica died before answering (%s); attempt %d of %d",
                               path, type(exc).__name__, attempt + 1, self.max_attempts)
                self.counts["retried_requests"] += 1
                continue
            if status == 503:  # draining or shedding load: it never started the request
                stream.cancel()
                refused.append(replica_id)
                self.counts["retried_requests"] += 1
                continue
            return StreamingResponse(self._rest(stream, first), status_code=status,
                                     headers={**passed, "x-serval-replica": replica_id})
        return error_response(f"no replica could take the request after {self.max_attempts} attempts; retry later",
                              503, "no_replica", {"Retry-After": "1"})

    async def _rest(self, stream, first: bytes):
        yield first
        try:
            async for chunk in stream:
                yield chunk
        except REPLICA_GONE as exc:  # started, so not retried: the client is told, not left with a cut stream
            self.counts["failed_streams"] += 1
            yield sse_error(f"the replica serving this request died ({type(exc).__name__}); retry the request")


def build_app(config: RayServeConfig):
    """The Ray Serve application: an ingress over one ServalReplica deployment per model."""
    total = config.num_replicas * len(config.models)
    threads = config.threads_per_replica or max(1, (os.cpu_count() or 1) // total)
    router = RequestRouterConfig(request_router_class=ServalRequestRouter,
                                 request_router_kwargs={"policy": config.policy})
    scaling: dict = {"num_replicas": config.num_replicas}
    if config.autoscale_max_replicas:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=config.num_replicas, initial_replicas=config.num_replicas,
            max_replicas=config.autoscale_max_replicas, target_ongoing_requests=config.target_ongoing_requests,
            upscale_delay_s=config.upscale_delay_s, downscale_delay_s=60.0,
            look_back_period_s=config.look_back_period_s)}
    deployments = {}
    for name, serve_args in config.models.items():
        deployment = serve.deployment(ServalReplica).options(
            name=f"serval-{name}", max_ongoing_requests=config.max_ongoing_requests,
            health_check_period_s=config.health_check_period_s, health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=10.0, ray_actor_options={"num_cpus": config.replica_cpus},
            request_router_config=router,
            **scaling)
        deployments[name] = deployment.bind(["--served-model-name", name, *serve_args], threads)
    ingress = serve.deployment(ServalIngress).options(name="serval-ingress", ray_actor_options={"num_cpus": 0},
                                                      max_ongoing_requests=1024)
    return ingress.bind(deployments, config.rules, config.api_keys, config.max_attempts)


def run(config: RayServeConfig, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
        blocking: bool = True):
    """Starts (or joins) Ray, deploys the application on Ray Serve's HTTP proxy at host:port, and (blocking) serves
    until interrupted."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    for attempt in range(1, 4):
        try:
            serve.start(http_options={"host": host, "port": port})
            break
        except (ray.exceptions.ActorDiedError, TimeoutError) as exc:  # on a busy machine the controller may kill a
            if attempt == 3:                                          # proxy slow to start
                raise
            logger.warning("Ray Serve's HTTP proxy did not start (%s); starting Serve again", type(exc).__name__)
            serve.shutdown()
    handle = serve.run(build_app(config), name="serval", route_prefix="/", blocking=False)
    if not blocking:
        return handle
    print(f"serval ray-serve: {', '.join(config.models)} on http://{host}:{port}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a service manager's stop: the same clean shutdown
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return None
