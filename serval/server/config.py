"""The HTTP fronts' settings: where one listens (`serve`, `router`, `ray-serve`) and the OpenAI server's own.

Light on purpose (no FastAPI, no torch): the CLI makes its flags from these fields (serval/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from serval.flags import flag
from serval.model.registry import DEFAULT_MODEL
from serval.server.filters import NoFilter, OutputFilter
from serval.tracing import Tracing


@dataclass
class ListenConfig:
    """Where an HTTP front listens, and the API keys it requires."""

    host: str = field(default="127.0.0.1", metadata=flag("address to listen on"))
    port: int = field(default=8000, metadata=flag("port to listen on"))
    # None in the flag's default: SERVAL_API_KEY from the environment joins these after parsing (cli._api_keys), so
    # that --help never prints it.
    api_keys: list[str] | None = field(default=None, metadata=flag(
        "require this key (repeatable); env SERVAL_API_KEY too", name="--api-key", action="append"))


# `serval router` listens on 8080 by default, beside `serval serve` replicas on 8000 and up.
ROUTER_LISTEN = ListenConfig(port=8080)


@dataclass
class ServerConfig:
    """The OpenAI-compatible server (server/app.py): its model's name, who may call it, and its limits."""

    served_model_name: str | None = field(default=None, metadata=flag(  # None: the embedded default model's name
        "the model's name in the API (default: the --model name or file stem)"))
    api_keys: list[str] = field(default_factory=list)  # empty: no auth
    protect_health: bool = field(default=False, metadata=flag("require the API key on /health"))
    protect_metrics: bool = field(default=False, metadata=flag("require the API key on /metrics"))
    max_waiting: int = field(default=256, metadata=flag(  # load shedding, counted in sequences (prompts × n)
        "503 for a request whose sequences (prompts × n) would queue past this many; 400 for one that never fits"))
    max_prompts_per_request: int = field(default=256, metadata=flag(
        "most prompts in one completions request (400 past it)"))
    max_body_bytes: int = field(default=1 << 20, metadata=flag("413 for a larger request body"))
    # Connections (server/connections.py): as nginx and uvicorn bound them, so a client cannot hold sockets forever.
    request_read_timeout: float = field(default=10.0, metadata=flag(
        "seconds a request's head and body may take to arrive, from the connection or the previous answer"))
    keep_alive_timeout: float = field(default=5.0, metadata=flag("seconds an idle keep-alive connection stays open"))
    max_connections: int = field(default=1000, metadata=flag("open connections past which a new one gets 503"))
    rate_limit_rpm: int | None = field(default=None, metadata=flag(
        "requests per minute per key (default: no limit)"))
    rate_limit_tpm: int | None = field(default=None, metadata=flag("tokens per minute per key (default: no limit)"))
    output_filter: OutputFilter = field(default_factory=NoFilter)
    tracing: Tracing | None = None  # OpenTelemetry spans of generation requests (serval/tracing.py)

    def __post_init__(self) -> None:
        if self.served_model_name is None:
            self.served_model_name = DEFAULT_MODEL
        for name in ("request_read_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerConfig.{name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name in ("max_waiting", "max_prompts_per_request", "max_connections"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)!r}")
