"""The settings of Serval's fronts over replicas: the standalone router (router.py) and Serval on Ray Serve
(ray_serve.py).

Light on purpose (no FastAPI, no Ray): the CLI makes `serval router`'s and `serval ray-serve`'s flags from these
fields (serval/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from serval.cluster.policy import POLICIES, VariantRules, make_policy
from serval.flags import flag
from serval.tracing import Tracing

POLICY_CHOICES = tuple(sorted(POLICIES))


@dataclass
class RouterConfig:
    replicas: list[str] = field(default_factory=list, metadata=flag(  # whole workers
        "a replica's base URL, e.g. http://127.0.0.1:8001 (repeatable)", name="--replica", action="append",
        metavar="URL"))
    prefill: list[str] = field(default_factory=list, metadata=flag(  # disaggregated: prefill workers, then ...
        "a prefill worker (serve --role prefill): each request's prompt runs there first, then on a --decode worker "
        "that fetches its KV (repeatable)", action="append", metavar="URL"))
    decode: list[str] = field(default_factory=list, metadata=flag(  # ... decode workers
        "a decode worker (serve --role decode) (repeatable)", action="append", metavar="URL"))
    policy: str = field(default="cache_aware", metadata=flag(
        "cache_aware: a shared prompt prefix goes where it went before, unless load is unbalanced; "
        "least_outstanding: the replica with the fewest requests in flight", choices=POLICY_CHOICES))
    api_keys: list[str] = field(default_factory=list)  # the router's own keys (empty: no auth)
    replica_api_key: str | None = field(default=None, metadata=flag(  # sent to the replicas
        "the key the replicas require, if any"))
    max_outstanding: int = field(default=64, metadata=flag(  # per replica: past it, none until one finishes
        "requests in flight per replica; past it on every replica: 503 with Retry-After"))
    health_interval: float = field(default=2.0, metadata=flag("seconds between health checks"))
    health_failures: int = field(default=2, metadata=flag(
        "failed health checks in a row that take a replica out (until one passes)"))
    max_body_bytes: int = 1 << 20
    request_timeout: float = 600.0
    rules: VariantRules | None = None  # which model variant serves a request (None: the model it names)
    tracing: Tracing | None = None  # OpenTelemetry: a span per routed request, traceparent passed to the replica

    def __post_init__(self) -> None:
        if not self.replicas and not self.decode:
            raise ValueError("the router needs at least one replica URL (--replica, or --prefill and --decode)")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode workers")
        make_policy(self.policy)  # a bad name fails here, with the choices
        if self.max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {self.max_outstanding}")


@dataclass
class RayServeConfig:
    """One Serval application on Ray Serve: a deployment per model (name -> `serval serve` flags)."""

    models: dict[str, list[str]]
    num_replicas: int = field(default=1, metadata=flag(  # per model, when not autoscaling
        "replicas per model (the minimum when autoscaling)"))
    autoscale_max_replicas: int = field(default=0, metadata=flag(
        "autoscale each model up to this many replicas on ongoing requests (0: fixed)"))
    target_ongoing_requests: float = field(default=4.0, metadata=flag(
        "the autoscaler's aim: requests in flight per replica"))
    max_ongoing_requests: int = field(default=32, metadata=flag(  # (and our router ranks others first)
        "requests in flight per replica; Ray Serve queues the rest"))
    upscale_delay_s: float = 5.0  # the autoscaler waits this long above target before adding a replica
    look_back_period_s: float = 30.0  # ... averaging ongoing requests over this window (Ray Serve's default)
    policy: str = field(default="cache_aware", metadata=flag(
        "Serval's routing policy, plugged into Ray Serve's request routing", choices=POLICY_CHOICES))
    rules: VariantRules | None = None
    api_keys: list[str] = field(default_factory=list)
    replica_cpus: float = field(default=0.0, metadata=flag(  # Ray resources a replica claims
        "CPUs each replica claims from Ray (0: replicas share this machine's cores)"))
    threads_per_replica: int | None = field(default=None, metadata=flag(  # OMP_NUM_THREADS of each `serval serve`
        "OMP_NUM_THREADS of each replica's engine (default: this machine's cores / replicas)"))
    max_attempts: int = 3  # replicas tried for a request that never started
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a Ray Serve application needs at least one model")
        make_policy(self.policy)
        if self.num_replicas < 1 or (self.autoscale_max_replicas and self.autoscale_max_replicas < self.num_replicas):
            raise ValueError("num_replicas must be >= 1 and autoscale_max_replicas, when set, >= num_replicas")
