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
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import serval
from serval.cluster.config import RouterConfig
from serval.cluster.policy import Replica, make_policy, prompt_text
from serval.lifetime import ending_with_parent
from serval.tracing import Tracing

logger = logging.getLogger("serval.router")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# Response headers worth passing on (hop-by-hop ones and the length of a body we re-stream are not).
PASSED_HEADERS = ("content-type", "retry-after", "x-request-id", "x-serval-dropped-messages", "cache-control")


class RouterMetrics:
    def __init__(self, replicas: list[Replica]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("serval_router:requests", "Requests routed, by replica and final status.",
                                ["replica", "status"], registry=r)
        self.retries = Counter("serval_router:retries", "Requests sent to another replica after one that never "
                               "started them (connection failed, or 503).", ["replica"], registry=r)
        self.rejected = Counter("serval_router:rejected", "Requests refused: no healthy replica, or all full.",
                                ["reason"], registry=r)
        self.latency = Histogram("serval_router:request_latency_seconds", "Arrival to last byte, per replica.",
                                 ["replica"], registry=r)
        self.outstanding = Gauge("serval_router:replica_outstanding", "Requests in flight.", ["replica"], registry=r)
        self.healthy = Gauge("serval_router:replica_healthy", "1 while the replica passes its health checks.",
                             ["replica"], registry=r)
        self.cut = Counter("serval_router:cut_responses", "Answers a replica started and then failed to finish.",
                           ["replica"], registry=r)
        self.kv_transfers = Counter("serval_router:kv_transfers", "Disaggregated requests by outcome of their "
                                    "prefill: prefilled (the prefill worker held the KV for the decode worker), "
                                    "fallback (no prefill worker could: the decode worker computed the prompt), "
                                    "cancelled (no decode worker took the request).",
                                    ["outcome"], registry=r)
        for replica in replicas:
            self.outstanding.labels(replica.url).set_function(lambda rep=replica: rep.outstanding)
            self.healthy.labels(replica.url).set_function(lambda rep=replica: int(rep.healthy))


def error_response(message: str, status: int, code: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status, headers=headers)


def sse_error(message: str, code: str = "replica_failed") -> bytes:
    """The last events of a stream cut by its replica: an OpenAI error object, then [DONE]."""
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def create_router_app(config: RouterConfig) -> FastAPI:
    replicas = [Replica(url.rstrip("/"), role) for urls, role in
                ((config.replicas, "both"), (config.prefill, "prefill"), (config.decode, "decode")) for url in urls]
    policy = make_policy(config.policy)
    prefill_policy = make_policy(config.policy)  # its own memory of which prefixes went where
    metrics = RouterMetrics(replicas)
    upstream_headers = {"Authorization": f"Bearer {config.replica_api_key}"} if config.replica_api_key else {}
    state: dict = {}
    prefill_tasks: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout, connect=5.0),
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        # One round of checks before the first request: the replicas' models and prefill workers' KV addresses.
        await asyncio.gather(*(check(r) for r in replicas))
        checker = asyncio.create_task(health_checks())
        yield
        checker.cancel()
        await state["client"].aclose()

    app = FastAPI(title="Serval router", version=serval.__version__, lifespan=lifespan)
    app.state.replicas, app.state.policy = replicas, policy

    async def check(replica: Replica) -> None:
        try:
            answer = await state["client"].get(f"{replica.url}/health", headers=upstream_headers, timeout=2.0)
            ok = answer.status_code == 200
            if ok and replica.role == "prefill":  # where decode workers fetch the KV it holds
                replica.kv_address = (answer.json().get("kv_transfer") or {}).get("address")
        except (httpx.HTTPError, ValueError, AttributeError):
            ok = False
        if ok:
            try:  # what it serves: requests for a model go only to replicas that list it
                listed = (await state["client"].get(f"{replica.url}/v1/models", headers=upstream_headers,
                                                    timeout=2.0)).json()
                replica.models = {m["id"] for m in listed.get("data", [])}
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            if not replica.healthy:
                logger.info("replica %s is healthy again: back in the rotation", replica.url)
            replica.healthy, replica.consecutive_failures = True, 0
        else:
            replica.consecutive_failures += 1
            if replica.healthy and replica.consecutive_failures >= config.health_failures:
                replica.healthy = False
                logger.warning("replica %s failed %d health checks: taken out", replica.url,
                               replica.consecutive_failures)

    async def health_checks() -> None:
        while True:
            await asyncio.sleep(config.health_interval)
            await asyncio.gather(*(check(r) for r in replicas))

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
        healthy = sum(r.healthy for r in replicas)
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_replicas": healthy,
                             "replicas": len(replicas)}, status_code=status)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def router_state():
        return {"policy": policy.name, "replicas": [
            {"url": r.url, "role": r.role, "models": sorted(r.models), "healthy": r.healthy,
             "outstanding": r.outstanding,
             "consecutive_failures": r.consecutive_failures, "known_prefixes": len(r.prefixes)} for r in replicas]}

    @app.get("/v1/models")
    async def models():
        seen: dict[str, dict] = {}
        for replica in [r for r in replicas if r.healthy]:
            try:
                response = await state["client"].get(f"{replica.url}/v1/models", headers=upstream_headers,
                                                     timeout=5.0)
                for model in response.json().get("data", []):
                    seen.setdefault(model["id"], model)
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        return {"object": "list", "data": list(seen.values())}

    async def route(request: Request):
        started = time.monotonic()
        tracing = config.tracing
        span = tracing.start_span(f"route {request.url.path}", request.headers, start_monotonic=started) \
            if tracing is not None else None
        response = await _route(request, started, span)
        if span is not None and not isinstance(response, StreamingResponse):  # refused: the route ends here
            span.set_attribute("http.status_code", response.status_code)
            span.end()
        return response

    async def _route(request: Request, started: float, span):
        body = await request.body()
        if len(body) > config.max_body_bytes:
            return error_response(f"request body over {config.max_body_bytes} bytes", 413, "request_too_large")
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise ValueError("not an object")
        except ValueError:
            return error_response("the request body is not a JSON object", 400, "invalid_json")
        prompt = prompt_text(payload)
        request_id = request.headers.get("x-request-id") or f"route-{uuid.uuid4().hex[:12]}"
        model, variant = payload.get("model"), "as asked"
        if config.rules is not None:
            model, variant = config.rules.resolve(model, {k.lower(): v for k, v in request.headers.items()}, prompt)
            if model != payload.get("model"):
                payload["model"] = model
                body = json.dumps(payload).encode()
        # Replicas whose models are known and do not include it cannot serve it.
        serving = [r for r in replicas if not isinstance(model, str) or not r.models or model in r.models]
        if not serving:
            known = sorted({m for r in replicas for m in r.models})
            return error_response(f"the model {model!r} is not served here (served: {', '.join(known)})", 404,
                                  "model_not_found")
        prefills = [r for r in serving if r.role == "prefill"]
        serving = [r for r in serving if r.role != "prefill"]
        extra_headers, prefill = {}, None
        if prefills and _pairable(request.url.path, payload):
            prefill = start_prefill(request.url.path, payload, prefills, prompt, request_id)
            if prefill is not None:
                replica, transfer_id, task = prefill
                payload = {**payload, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id,
                                                             "remote_address": replica.kv_address}}
                body = json.dumps(payload).encode()
                extra_headers["x-serval-prefill-replica"] = replica.url
            else:
                metrics.kv_transfers.labels("fallback").inc()
        response = await to_decode(request, body, serving, prompt, request_id, model, variant, span, started,
                                   extra_headers)
        if prefill is not None and isinstance(response, JSONResponse):  # refused: no decode worker will fetch it
            prefill[2].cancel()  # closing the connection aborts the prefill: its blocks are freed now
        return response

    async def to_decode(request: Request, body: bytes, serving: list[Replica], prompt: str, request_id: str, model,
                        variant: str, span, started: float, extra_headers: dict):
        """Sends the request to a replica (a decode worker, or a whole one) and passes its answer through."""
        tried: set[str] = set()
        while True:
            candidates = [r for r in serving if r.healthy and r.url not in tried]
            if not candidates:
                reason = "no healthy replica" if not tried and not any(r.healthy for r in replicas) else \
                    "every replica refused or failed it"
                metrics.rejected.labels("unavailable").inc()
                return error_response(f"{reason}; retry later", 503, "no_replica", {"Retry-After": "1"})
            open_ = [r for r in candidates if r.outstanding < config.max_outstanding]
            if not open_:
                metrics.rejected.labels("full").inc()
                return error_response(f"every replica has {config.max_outstanding} requests in flight; retry later",
                                      503, "overloaded", {"Retry-After": "1"})
            decision = policy.choose(prompt, open_)
            replica = decision.replica
            tried.add(replica.url)
            replica.outstanding += 1
            headers = {**upstream_headers, "content-type": "application/json", "x-request-id": request_id}
            attempt = None
            if span is not None:  # the call to the replica: its traceparent makes the replica's span a child
                attempt = config.tracing.start_span(f"POST {replica.url}{request.url.path}", parent=span,
                                                    kind="CLIENT")
                attempt.set_attributes({"serval.replica": replica.url, "serval.routing.policy": policy.name,
                                        "serval.routing.reason": decision.reason, "serval.model": str(model),
                                        "serval.routing.variant": variant})
                Tracing.inject(attempt, headers)
            upstream = state["client"].build_request("POST", f"{replica.url}{request.url.path}", content=body,
                                                     headers=headers)
            try:
                response = await state["client"].send(upstream, stream=True)
            except httpx.TransportError as exc:  # never reached the replica: another one may serve it
                if attempt is not None:
                    attempt.set_attribute("error.type", type(exc).__name__)
                    attempt.end()
                replica.outstanding -= 1
                replica.consecutive_failures += 1
                replica.healthy = False
                logger.warning("request %s: replica %s unreachable (%s); taken out, retrying elsewhere", request_id,
                               replica.url, type(exc).__name__)
                metrics.retries.labels(replica.url).inc()
                continue
            chunks, first, failure = response.aiter_raw(), b"", None
            if response.status_code != 503:
                try:  # nothing reaches the client before the replica's first bytes
                    first = await anext(chunks, b"")
                except httpx.HTTPError as exc:
                    failure = type(exc).__name__
            if response.status_code == 503 or failure is not None:  # it started nothing the client saw
                if attempt is not None:
                    if failure is None:
                        attempt.set_attribute("http.status_code", 503)
                    else:
                        attempt.set_attribute("error.type", failure)
                    attempt.end()
                await response.aclose()
                replica.outstanding -= 1
                if failure is not None:  # died: out until a health check passes
                    replica.healthy, replica.consecutive_failures = False, replica.consecutive_failures + 1
                logger.info("request %s: replica %s %s; retrying elsewhere", request_id, replica.url,
                            "answered 503" if failure is None else f"failed before answering ({failure})")
                metrics.retries.labels(replica.url).inc()
                continue
            policy.routed(prompt, replica)
            logger.info("request %s %s model %s (%s) -> %s (%s: %s) %d", request_id, request.url.path, model, variant,
                        replica.url, policy.name, decision.reason, response.status_code)
            return _passthrough(response, chunks, first, replica, request_id, started, (attempt, span),
                                extra_headers)

    def start_prefill(path: str, payload: dict, prefills: list[Replica], prompt: str, request_id: str):
        """Starts the prompt on a prefill worker, under a transfer id the decode worker is given at the same time:
        the decode worker fetches the blocks while they are computed. (the worker, the transfer id, the task), or
        None when no prefill worker is free (the decode worker then computes the prompt)."""
        candidates = [r for r in prefills if r.healthy and r.kv_address and r.outstanding < config.max_outstanding]
        if not candidates:
            logger.warning("request %s: no prefill worker free; the decode worker computes the prompt", request_id)
            return None
        replica = prefill_policy.choose(prompt, candidates).replica
        prefill_policy.routed(prompt, replica)
        transfer_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        ask = {**payload, "max_tokens": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}}
        for key in ("stream_options", "min_tokens"):
            ask.pop(key, None)
        if "max_completion_tokens" in ask:
            ask["max_completion_tokens"] = 1
        replica.outstanding += 1
        task = asyncio.create_task(run_prefill(replica, path, ask, request_id))
        prefill_tasks.add(task)  # held until done: the event loop keeps only weak references to tasks
        task.add_done_callback(prefill_tasks.discard)
        return replica, transfer_id, task

    async def run_prefill(replica: Replica, path: str, ask: dict, request_id: str) -> None:
        outcome = "fallback"
        try:
            response = await state["client"].post(f"{replica.url}{path}", json=ask,
                                                  headers={**upstream_headers, "x-request-id": f"{request_id}-prefill"})
            if response.status_code == 200 and response.json().get("kv_transfer_params"):
                outcome = "prefilled"
            else:
                logger.warning("request %s: prefill worker %s answered %d without held KV; the decode worker "
                               "computes the prompt", request_id, replica.url, response.status_code)
        except httpx.TransportError as exc:
            replica.healthy, replica.consecutive_failures = False, replica.consecutive_failures + 1
            logger.warning("request %s: prefill worker %s unreachable (%s); taken out", request_id, replica.url,
                           type(exc).__name__)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            replica.outstanding -= 1
            metrics.kv_transfers.labels(outcome).inc()

    def _passthrough(response: httpx.Response, chunks, first: bytes, replica: Replica, request_id: str,
                     started: float, spans, extra_headers: dict | None = None):
        headers = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}
        headers["x-serval-replica"] = replica.url
        headers.update(extra_headers or {})
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")

        async def body():
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as exc:  # the replica died mid-answer: say so, never end silently
                logger.warning("request %s: replica %s failed mid-answer (%s)", request_id, replica.url,
                               type(exc).__name__)
                metrics.cut.labels(replica.url).inc()
                if streamed:
                    yield sse_error(f"the replica serving this request failed ({type(exc).__name__}); retry the "
                                    "request")
            finally:  # finished, failed, or the client went away (the replica then sees its disconnect)
                await response.aclose()
                replica.outstanding -= 1
                metrics.requests.labels(replica.url, str(response.status_code)).inc()
                metrics.latency.labels(replica.url).observe(time.monotonic() - started)
                for span in spans:  # the replica call, then the route
                    if span is not None:
                        span.set_attribute("http.status_code", response.status_code)
                        span.end()

        return StreamingResponse(body(), status_code=response.status_code, headers=headers)

    for path in GENERATION_PATHS:
        app.add_api_route(path, route, methods=["POST"])
    return app


def _pairable(path: str, payload: dict) -> bool:
    """Whether a request can run disaggregated: one prompt, one sample, no echo (its KV is one sample's)."""
    if path not in ("/v1/completions", "/v1/chat/completions") or payload.get("kv_transfer_params"):
        return False
    if payload.get("n", 1) not in (1, None) or payload.get("echo") or payload.get("prompt_logprobs"):
        return False
    prompt = payload.get("prompt")
    return not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)))


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
