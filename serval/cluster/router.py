"""`serval router`: one OpenAI-compatible front over several `serval serve` replicas.

Each generation request goes to the replica its policy picks (cluster/policy.py); its response, streamed or not,
is passed through byte for byte. A request that never started on a replica (the connection failed, the replica
answered 503 (draining or shedding load), or it died before its first bytes: the router holds a response until
then) is sent to another one; once a replica has started answering, its answer is the answer, and one that dies
later ends a stream with an SSE error event. With prefill workers (``--prefill``, `serve --role prefill`) and
decode workers (``--decode``), a request goes to both at once under a transfer id the router names: the prefill
worker computes its prompt (one token; the KV is held there) and the decode worker fetches that KV as it is computed
(engine/kv_transfer.py) and streams the answer; a prefill worker that fails or is missing only costs the decode
worker the prompt's computation. Replicas are health-checked (GET /health) before the first request and then in
the background: one that fails ``health_failures`` checks in a row (or refuses a connection) is taken out until a
check passes again. When every healthy replica has ``max_outstanding`` requests in flight the
router answers 503 with Retry-After, without asking any. The router has its own API keys, request log (which
replica, and why) and Prometheus metrics, per replica and in total.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import serval
from serval.cluster.config import RouterConfig
from serval.cluster.proxy import ReplicaProxy, error_response
from serval.lifetime import ending_with_parent

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def create_router_app(config: RouterConfig) -> FastAPI:
    proxy = ReplicaProxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        checker = await proxy.start()
        yield
        checker.cancel()
        await proxy.close()

    app = FastAPI(title="Serval router", version=serval.__version__, lifespan=lifespan)
    app.state.replicas, app.state.policy = proxy.replicas, proxy.policy

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if config.api_keys and request.url.path not in ("/health",):
            header = request.headers.get("authorization", "")
            if header.removeprefix("Bearer ").strip() not in config.api_keys:
                return error_response("invalid or missing API key (send Authorization: Bearer KEY)", 401,
                                      "invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        healthy = sum(r.healthy for r in proxy.replicas)
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_replicas": healthy,
                             "replicas": len(proxy.replicas)}, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def router_state():
        return proxy.state()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": await proxy.served_models()}

    for path in GENERATION_PATHS:
        app.add_api_route(path, proxy.route, methods=["POST"])
    return app


def spawn_replicas(count: int, serve_args: list[str],
                   timeout: float = 300.0) -> tuple[list[subprocess.Popen], list[str]]:
    """Starts ``count`` `serval serve` processes on free loopback ports and waits until each is healthy. They share
    the machine's cores (OMP_NUM_THREADS, unless set, is the cores over ``count``): replicas each spinning a thread
    per core would take turns on the same cores (measured: 2 replicas on 2 cores ran 10x slower than one)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
    procs, urls = [], []
    for _ in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(subprocess.Popen([sys.executable, "-m", "serval.cli", "serve", "--port", str(port),
                                       *serve_args], env=env, preexec_fn=ending_with_parent(signal.SIGTERM)))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    for proc, url in zip(procs, urls):
        while True:
            if proc.poll() is not None:
                for other in procs:
                    other.terminate()
                raise RuntimeError(f"replica {url} exited with {proc.returncode} while starting")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                for other in procs:
                    other.terminate()
                raise RuntimeError(f"replica {url} not healthy after {timeout} s")
            time.sleep(0.5)
    return procs, urls
