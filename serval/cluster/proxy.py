"""The router's work behind its routes: which replicas are healthy, and sending a request to one of them.

`ReplicaProxy` owns the replicas' state, the HTTP client to them, the routing policies and the router's metrics.
A request that never started on a replica (the connection failed, the replica answered 503, or it died before its
first bytes: the proxy holds a response until then) is sent to another one; once a replica has started answering,
its answer is passed through byte for byte, and one that dies later ends a stream with an SSE error event. With
prefill workers, a request goes to a prefill worker and a decode worker at once under one transfer id
(engine/kv_transfer.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serval.cluster.config import RouterConfig
from serval.cluster.policy import Replica, make_policy, prompt_text
from serval.tracing import Tracing

logger = logging.getLogger("serval.router")
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


class ReplicaProxy:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas = [Replica(url.rstrip("/"), role) for urls, role in
                         ((config.replicas, "both"), (config.prefill, "prefill"), (config.decode, "decode"))
                         for url in urls]
        self.policy = make_policy(config.policy)
        self.prefill_policy = make_policy(config.policy)  # its own memory of which prefixes went where
        self.metrics = RouterMetrics(self.replicas)
        self.upstream_headers = {"Authorization": f"Bearer {config.replica_api_key}"} \
            if config.replica_api_key else {}
        self.client: httpx.AsyncClient | None = None  # opened in start(): it belongs to the server's event loop
        self.prefill_tasks: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references

    # -- lifetime and health --------------------------------------------------------------------------------------

    async def start(self) -> asyncio.Task:
        """Opens the client, checks every replica once (their models, prefill workers' KV addresses) and starts
        the background checks; returns their task."""
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        await self.check_all()
        return asyncio.create_task(self._health_checks())

    async def close(self) -> None:
        await self.client.aclose()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def _health_checks(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self.check_all()

    async def check(self, replica: Replica) -> None:
        try:
            answer = await self.client.get(f"{replica.url}/health", headers=self.upstream_headers, timeout=2.0)
            ok = answer.status_code == 200
            if ok and replica.role == "prefill":  # where decode workers fetch the KV it holds
                replica.kv_address = (answer.json().get("kv_transfer") or {}).get("address")
        except (httpx.HTTPError, ValueError, AttributeError):
            ok = False
        if ok:
            try:  # what it serves: requests for a model go only to replicas that list it
                listed = (await self.client.get(f"{replica.url}/v1/models", headers=self.upstream_headers,
                                                timeout=2.0)).json()
                replica.models = {m["id"] for m in listed.get("data", [])}
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            if not replica.healthy:
                logger.info("replica %s is healthy again: back in the rotation", replica.url)
            replica.healthy, replica.consecutive_failures = True, 0
        else:
            replica.consecutive_failures += 1
            if replica.healthy and replica.consecutive_failures >= self.config.health_failures:
                replica.healthy = False
                logger.warning("replica %s failed %d health checks: taken out", replica.url,
                               replica.consecutive_failures)

    async def served_models(self) -> list[dict]:
        """The models the healthy replicas list, each once."""
        seen: dict[str, dict] = {}
        for replica in [r for r in self.replicas if r.healthy]:
            try:
                response = await self.client.get(f"{replica.url}/v1/models", headers=self.upstream_headers,
                                                 timeout=5.0)
                for model in response.json().get("data", []):
                    seen.setdefault(model["id"], model)
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        return list(seen.values())

    def state(self) -> dict:
        return {"policy": self.policy.name, "replicas": [
            {"url": r.url, "role": r.role, "models": sorted(r.models), "healthy": r.healthy,
             "outstanding": r.outstanding,
             "consecutive_failures": r.consecutive_failures, "known_prefixes": len(r.prefixes)}
            for r in self.replicas]}

    # -- routing ------------------------------------------------------------------------------------------------

    async def route(self, request: Request):
        started = time.monotonic()
        tracing = self.config.tracing
        span = tracing.start_span(f"route {request.url.path}", request.headers, start_monotonic=started) \
            if tracing is not None else None
        response = await self._route(request, started, span)
        if span is not None and not isinstance(response, StreamingResponse):  # refused: the route ends here
            span.set_attribute("http.status_code", response.status_code)
            Tracing.end(span)
        return response

    async def _route(self, request: Request, started: float, span):
        body = await request.body()
        if len(body) > self.config.max_body_bytes:
            return error_response(f"request body over {self.config.max_body_bytes} bytes", 413, "request_too_large")
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise ValueError("not an object")
        except ValueError:
            return error_response("the request body is not a JSON object", 400, "invalid_json")
        prompt = prompt_text(payload)
        request_id = request.headers.get("x-request-id") or f"route-{uuid.uuid4().hex[:12]}"
        model, variant = payload.get("model"), "as asked"
        if self.config.rules is not None:
            model, variant = self.config.rules.resolve(model, {k.lower(): v for k, v in request.headers.items()},
                                                       prompt)
            if model != payload.get("model"):
                payload["model"] = model
                body = json.dumps(payload).encode()
        # Replicas whose models are known and do not include it cannot serve it.
        serving = [r for r in self.replicas if not isinstance(model, str) or not r.models or model in r.models]
        if not serving:
            known = sorted({m for r in self.replicas for m in r.models})
            return error_response(f"the model {model!r} is not served here (served: {', '.join(known)})", 404,
                                  "model_not_found")
        prefills = [r for r in serving if r.role == "prefill"]
        serving = [r for r in serving if r.role != "prefill"]
        extra_headers, prefill = {}, None
        if prefills and _pairable(request.url.path, payload):
            prefill = self.start_prefill(request.url.path, payload, prefills, prompt, request_id)
            if prefill is not None:
                replica, transfer_id, task = prefill
                payload = {**payload, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id,
                                                             "remote_address": replica.kv_address}}
                body = json.dumps(payload).encode()
                extra_headers["x-serval-prefill-replica"] = replica.url
            else:
                self.metrics.kv_transfers.labels("fallback").inc()
        call = _Call(request.url.path, body, prompt, request_id, model, variant, span, started, extra_headers)
        response = await self.to_decode(call, serving)
        if prefill is not None and isinstance(response, JSONResponse):  # refused: no decode worker will fetch it
            prefill[2].cancel()  # closing the connection aborts the prefill: its blocks are freed now
        return response

    async def to_decode(self, call: _Call, serving: list[Replica]):
        """Sends the request to a replica (a decode worker, or a whole one) and passes its answer through."""
        tried: set[str] = set()
        while True:
            candidates = [r for r in serving if r.healthy and r.url not in tried]
            if not candidates:
                reason = "no healthy replica" if not tried and not any(r.healthy for r in self.replicas) else \
                    "every replica refused or failed it"
                self.metrics.rejected.labels("unavailable").inc()
                return error_response(f"{reason}; retry later", 503, "no_replica", {"Retry-After": "1"})
            open_ = [r for r in candidates if r.outstanding < self.config.max_outstanding]
            if not open_:
                self.metrics.rejected.labels("full").inc()
                return error_response(f"every replica has {self.config.max_outstanding} requests in flight; retry "
                                      "later", 503, "overloaded", {"Retry-After": "1"})
            decision = self.policy.choose(call.prompt, open_)
            tried.add(decision.replica.url)
            response = await self._attempt(call, decision)
            if response is not None:
                return response

    async def _attempt(self, call: _Call, decision) -> StreamingResponse | None:
        """The request on the replica ``decision`` chose: its answer once its first bytes came, or None when it
        started nothing the client saw (unreachable, 503, or dead before answering: another replica may serve it)."""
        replica = decision.replica
        replica.outstanding += 1
        headers = {**self.upstream_headers, "content-type": "application/json", "x-request-id": call.request_id}
        attempt = None
        if call.span is not None:  # the call to the replica: its traceparent makes the replica's span a child
            attempt = self.config.tracing.start_span(f"POST {replica.url}{call.path}", parent=call.span,
                                                     kind="CLIENT")
            attempt.set_attributes({"serval.replica": replica.url, "serval.routing.policy": self.policy.name,
                                    "serval.routing.reason": decision.reason, "serval.model": str(call.model),
                                    "serval.routing.variant": call.variant})
            Tracing.inject(attempt, headers)
        upstream = self.client.build_request("POST", f"{replica.url}{call.path}", content=call.body, headers=headers)
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.TransportError as exc:  # never reached the replica: another one may serve it
            if attempt is not None:
                attempt.set_attribute("error.type", type(exc).__name__)
                Tracing.end(attempt)
            replica.outstanding -= 1
            replica.consecutive_failures += 1
            replica.healthy = False
            logger.warning("request %s: replica %s unreachable (%s); taken out, retrying elsewhere", call.request_id,
                           replica.url, type(exc).__name__)
            self.metrics.retries.labels(replica.url).inc()
            return None
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
                Tracing.end(attempt)
            await response.aclose()
            replica.outstanding -= 1
            if failure is not None:  # died: out until a health check passes
                replica.healthy, replica.consecutive_failures = False, replica.consecutive_failures + 1
            logger.info("request %s: replica %s %s; retrying elsewhere", call.request_id, replica.url,
                        "answered 503" if failure is None else f"failed before answering ({failure})")
            self.metrics.retries.labels(replica.url).inc()
            return None
        self.policy.routed(call.prompt, replica)
        logger.info("request %s %s model %s (%s) -> %s (%s: %s) %d", call.request_id, call.path, call.model,
                    call.variant, replica.url, self.policy.name, decision.reason, response.status_code)
        return self._passthrough(response, chunks, first, replica, call, attempt)

    def _passthrough(self, response: httpx.Response, chunks, first: bytes, replica: Replica, call: _Call, attempt):
        headers = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}
        headers["x-serval-replica"] = replica.url
        headers.update(call.extra_headers)
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        metrics = self.metrics

        async def body():
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as exc:  # the replica died mid-answer: say so, never end silently
                logger.warning("request %s: replica %s failed mid-answer (%s)", call.request_id, replica.url,
                               type(exc).__name__)
                metrics.cut.labels(replica.url).inc()
                if streamed:
                    yield sse_error(f"the replica serving this request failed ({type(exc).__name__}); retry the "
                                    "request")
            finally:  # finished, failed, or the client went away (the replica then sees its disconnect)
                await response.aclose()
                replica.outstanding -= 1
                metrics.requests.labels(replica.url, str(response.status_code)).inc()
                metrics.latency.labels(replica.url).observe(time.monotonic() - call.started)
                for span in (attempt, call.span):  # the replica call, then the route
                    if span is not None:
                        span.set_attribute("http.status_code", response.status_code)
                        Tracing.end(span)

        return StreamingResponse(body(), status_code=response.status_code, headers=headers)

    # -- disaggregated prefill ----------------------------------------------------------------------------------

    def start_prefill(self, path: str, payload: dict, prefills: list[Replica], prompt: str, request_id: str):
        """Starts the prompt on a prefill worker, under a transfer id the decode worker is given at the same time:
        the decode worker fetches the blocks while they are computed. (the worker, the transfer id, the task), or
        None when no prefill worker is free (the decode worker then computes the prompt)."""
        candidates = [r for r in prefills
                      if r.healthy and r.kv_address and r.outstanding < self.config.max_outstanding]
        if not candidates:
            logger.warning("request %s: no prefill worker free; the decode worker computes the prompt", request_id)
            return None
        replica = self.prefill_policy.choose(prompt, candidates).replica
        self.prefill_policy.routed(prompt, replica)
        transfer_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        ask = {**payload, "max_tokens": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}}
        for key in ("stream_options", "min_tokens"):
            ask.pop(key, None)
        if "max_completion_tokens" in ask:
            ask["max_completion_tokens"] = 1
        replica.outstanding += 1
        task = asyncio.create_task(self._run_prefill(replica, path, ask, request_id))
        self.prefill_tasks.add(task)
        task.add_done_callback(self.prefill_tasks.discard)
        return replica, transfer_id, task

    async def _run_prefill(self, replica: Replica, path: str, ask: dict, request_id: str) -> None:
        outcome = "fallback"
        try:
            response = await self.client.post(f"{replica.url}{path}", json=ask, headers={
                **self.upstream_headers, "x-request-id": f"{request_id}-prefill"})
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
            self.metrics.kv_transfers.labels(outcome).inc()


@dataclass
class _Call:
    """One routed request: what every attempt on a replica sends and reports."""

    path: str
    body: bytes
    prompt: str
    request_id: str
    model: object
    variant: str
    span: object
    started: float
    extra_headers: dict


def _pairable(path: str, payload: dict) -> bool:
    """Whether a request can run disaggregated: one prompt, one sample, no echo (its KV is one sample's)."""
    if path not in ("/v1/completions", "/v1/chat/completions") or payload.get("kv_transfer_params"):
        return False
    if payload.get("n", 1) not in (1, None) or payload.get("echo") or payload.get("prompt_logprobs"):
        return False
    prompt = payload.get("prompt")
    return not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)))
