"""The `serval` command: generate, chat, serve, bench, models."""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
import threading
import time

from serval.benchmark import quality as quality_benchmark
from serval.benchmark import serve as serve_benchmark  # light: the flags; torch and aiohttp load when a run starts
from serval.benchmark import throughput as throughput_benchmark
from serval.cluster.config import RayServeConfig, RouterConfig
from serval.config import EngineConfig, resolve_device
from serval.flags import add_flags, from_args
from serval.model.registry import DEFAULT_MODEL
from serval.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams
from serval.server.config import ROUTER_LISTEN, ListenConfig, ServerConfig
from serval.server.tls import TLSConfig


def _engine_args(parser: argparse.ArgumentParser, kv_transfer: bool = False) -> None:
    """The engine's flags, made from EngineConfig and the configs in it; the KV transfer's only where a worker can
    be one side of a transfer (serve)."""
    add_flags(parser, EngineConfig, exclude=() if kv_transfer else ("kv_transfer",))


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens in an answer")
    # Greedy by default, so that a command's answer is the same every run; the other sampling flags, when unset,
    # take the model's defaults (--generation-config), as the server does for a request that leaves them out.
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling: 1 is off (unset: the model's default, else 1)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample from the k most likely tokens: 0 is off (unset: the model's default, else 0)")
    parser.add_argument("--min-p", type=float, default=None, help="drop tokens less likely than this fraction of "
                        "the top one: 0 is off (unset: the model's default, else 0)")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="1 is off (unset: the model's default, else 1)")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _engine_config(args: argparse.Namespace):
    """The engine flags, shared by serve, generate and chat, as one EngineConfig."""
    return from_args(EngineConfig, args)


def _build_llm(args: argparse.Namespace):
    from serval.engine.engine import LLMEngine
    from serval.engine.llm import LLM

    return LLM.from_engine(LLMEngine(_engine_config(args)))


def _sampling_params(args: argparse.Namespace, defaults: dict) -> SamplingParams:
    """The sampling flags given, over ``defaults`` (the model's) for those left unset."""
    given = {name: getattr(args, name) for name in MODEL_DEFAULT_FIELDS if getattr(args, name) is not None}
    return SamplingParams(**{**defaults, **given}, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    params = _sampling_params(args, llm.engine.sampling_defaults.values)
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        outputs = llm.chat([messages + [{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=False)
    elapsed = time.perf_counter() - start
    for output in outputs:
        print(output.text)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{tokens} tokens in {elapsed:.2f} s, {tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    return run_chat(llm.engine, _sampling_params(args, llm.engine.sampling_defaults.values), args.system)


def run_chat(engine, params: SamplingParams, system: str | None = None) -> int:
    """The interactive chat on ``engine`` (an LLMEngine). Ctrl-C during an answer stops that answer and returns to
    the prompt; at the prompt, Ctrl-C, Ctrl-D or an empty line quits."""
    messages = [{"role": "system", "content": system}] if system else []
    print("serval chat — Ctrl-C stops an answer; an empty line, Ctrl-C or Ctrl-D quits", file=sys.stderr)
    # Ctrl-C is the chat's own control, however it was started: a process a script starts in the background
    # (`cmd &`) inherits SIGINT ignored, and then Python never raises KeyboardInterrupt: Ctrl-C at the prompt was lost
    previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # outside an answer, Ctrl-C quits wherever it lands: at the prompt or in the few lines around it
        with _StdinLines() as lines:
            _chat_turns(engine, params, messages, lines)
    except (EOFError, KeyboardInterrupt):
        print()  # the shell's prompt starts on a line of its own
    finally:
        signal.signal(signal.SIGINT, previous_sigint)
    return 0


def _chat_turns(engine, params: SamplingParams, messages: list[dict], lines: _StdinLines) -> None:
    """Question, answer, until an empty line."""
    from serval.chat import build_chat_prompt
    from serval.sampling_params import prompt_room

    turn = 0
    while line := lines.read("you> ").strip():
        messages.append({"role": "user", "content": line})
        try:
            prompt = build_chat_prompt(engine.tokenizer, messages, prompt_room(engine.max_model_len, params.max_tokens),
                                       engine.config.context_policy)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            messages.pop()
            continue
        if prompt.num_dropped_messages:
            print(f"[context full: dropped the {prompt.num_dropped_messages} oldest messages]", file=sys.stderr)
        answer, stopped = _stream_answer(engine, f"chat-{turn}", prompt.token_ids, params)
        turn += 1
        if stopped:
            print("[stopped]", file=sys.stderr)
        if answer or not stopped:
            messages.append({"role": "assistant", "content": answer})  # a stopped answer stays as far as it got
        else:
            messages.pop()  # stopped before a word: as if the question was never asked


def _stream_answer(engine, request_id: str, prompt_ids: list[int], params: SamplingParams) -> tuple[str, bool]:
    """Streams one answer to stdout. Returns its text and whether Ctrl-C stopped it (the request is then aborted,
    which frees its KV blocks)."""
    with _InterruptFlag() as interrupt:
        engine.add_request(request_id, prompt_ids, params)
        print("assistant> ", end="", flush=True)
        answer = ""
        aborted = finished = False
        while not finished:
            if interrupt.pending and not aborted:
                engine.abort_request(request_id)  # its final output comes from the next step
                aborted = True
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                print(output.text[len(answer):], end="", flush=True)
                answer = output.text
                finished = output.finished
        print()
    return answer, aborted


class _StdinLines:
    """The chat's lines from stdin, one at a time after a prompt, never losing a Ctrl-C. input() writes the prompt and
    then blocks in read(): a SIGINT that lands between the two (just as the prompt shows) only marks the Python
    handler as due, and nothing runs it until the read returns. Here the wait is a select() that also watches the
    signal's wakeup byte (signal.set_wakeup_fd, installed for the whole chat), which the C handler writes whenever and
    in whichever thread the signal lands; the due KeyboardInterrupt is raised as soon as select() returns."""

    def __enter__(self) -> _StdinLines:
        self._fd = sys.stdin.fileno()
        self._encoding = sys.stdin.encoding or "utf-8"
        self._buffer = b""  # read but not yet returned: a pipe may bring several lines at once
        self._at_end = False
        self._wakeup_read, self._wakeup_write = os.pipe()
        for fd in (self._wakeup_read, self._wakeup_write):
            os.set_blocking(fd, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._wakeup_write, warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc_info) -> None:
        signal.set_wakeup_fd(self._previous_wakeup)
        os.close(self._wakeup_read)
        os.close(self._wakeup_write)

    def read(self, prompt: str) -> str:
        """The next line without its newline; EOFError at the end of input, KeyboardInterrupt on Ctrl-C."""
        self._drain_wakeups()  # an answer's Ctrl-C, already handled
        print(prompt, end="", flush=True)
        while b"\n" not in self._buffer and not self._at_end:
            ready = select.select([self._fd, self._wakeup_read], [], [])[0]  # in the main thread a signal is EINTR
            if self._wakeup_read in ready:
                self._drain_wakeups()  # the signal's handler runs before the loop goes round
                continue
            chunk = os.read(self._fd, 4096)
            self._buffer += chunk
            self._at_end = not chunk
        if not self._buffer:
            raise EOFError
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(self._encoding, errors="replace")

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wakeup_read, 512):
                pass
        except BlockingIOError:
            pass


class _InterruptFlag:
    """While active, Ctrl-C (SIGINT) sets ``pending`` instead of raising KeyboardInterrupt: an exception in the
    middle of an engine step could leave a KV block neither free nor owned by anyone."""

    def __init__(self) -> None:
        self.pending = False

    def __enter__(self) -> _InterruptFlag:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame) -> None:
        self.pending = True


def cmd_serve(args: argparse.Namespace) -> int:
    # The port first: taken, the start fails in a second with one line, before the model loads (uvicorn listens on
    # this very socket once the engine is ready, so no other process can take the port in between).
    try:
        listener = _bind(args.host, args.port)
    except OSError as exc:
        print(f"serval: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    # SIGTERM while loading stops the load: the engine core is killed and its folder removed (CoreProcessClient).
    signal.signal(signal.SIGTERM, _stop_loading)
    engines: list = []  # the engine once loaded, stopped here however the server ends
    try:
        _serve(args, listener, engines)
    except _StopLoading:
        print("serval: stopped by SIGTERM while loading", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the shutdown below is bounded; a second SIGTERM waits for it
        for engine in engines:
            engine.shutdown()
        listener.close()
    if engines and engines[0].error is not None:
        print(f"serval: exiting with code 1: the engine died ({engines[0].error}); whatever supervises the server "
              "should start it again", file=sys.stderr, flush=True)
        return 1
    return 0


class _StopLoading(BaseException):
    """SIGTERM before the server runs (BaseException: nothing on the way catches it as an error)."""


def _stop_loading(signum: int, frame) -> None:
    raise _StopLoading


def _bind(host: str, port: int):
    """A TCP socket listening on host:port. Taken before the model loads, the port is this server's alone; until the
    engine is ready, connections wait in the backlog (a health probe times out) and are answered once it is."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart binds at once
        sock.bind((host, port))
        sock.listen(2048)  # as uvicorn's backlog; without it another SO_REUSEADDR socket could bind the port too
    except OSError:
        sock.close()
        raise
    return sock


def _serve(args: argparse.Namespace, listener, engines: list) -> None:
    """Loads the engine (appended to ``engines``) and serves on ``listener`` until a signal or the engine's death."""
    tls = from_args(TLSConfig, args)
    tls.validate()  # before the model loads: a bad certificate fails in a second, with one line
    config = _engine_config(args)
    server_config = _server_config(args)
    # One line per request at INFO whatever --log-level says (unless disabled): an operator sees traffic by default.
    root_level = logging.getLogger().level
    logging.getLogger("serval.requests").setLevel(logging.WARNING if args.disable_log_requests
                                                  else min(logging.INFO, root_level))
    print(f"serval: loading {server_config.served_model_name} ...", file=sys.stderr, flush=True)
    if args.engine_in_process:
        from serval.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_config(config)
    else:  # the server's process imports neither the engine core nor torch
        from serval.engine.core_client import CoreProcessClient

        # The HTTP server's modules (1-2 s of imports) while the core loads, not before its process starts.
        engine = CoreProcessClient.from_config(config, while_loading=_import_server_modules)
    engines.append(engine)
    engine.start()
    import uvicorn

    from serval.server.app import create_app
    from serval.server.connections import guarded_protocol

    app = create_app(engine, server_config)
    scheme = "https" if tls.enabled else "http"
    print(f"serval: engine ready in {engine.load_time:.1f} s; serving on {scheme}://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    print(f"serval: sampling defaults {engine.sampling_defaults.describe()}; a request's own values win",
          file=sys.stderr, flush=True)
    print(f"serval: chat template: {engine.tokenizer.chat_template_source}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           access_log=False,  # serval.requests has a line per request already
                                           http=guarded_protocol(server_config.request_read_timeout,
                                                                 server_config.max_connections),
                                           timeout_keep_alive=server_config.keep_alive_timeout,
                                           # a backstop: the drain has aborted what still ran by then
                                           timeout_graceful_shutdown=args.shutdown_timeout + ABORTED_ANSWER_S,
                                           **tls.uvicorn_kwargs()))
    _drain_on_sigterm(server, app, engine, args.shutdown_timeout)
    _exit_when_engine_dies(server, engine)
    server.run(sockets=[listener])


def _import_server_modules() -> None:
    import uvicorn  # noqa: F401

    import serval.server.app  # noqa: F401
    import serval.server.connections  # noqa: F401


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """serve's flags as the server's ServerConfig (the engine's are _engine_config's)."""
    from serval.server.filters import BlocklistFilter, NoFilter

    return from_args(ServerConfig, args, served_model_name=args.served_model_name or _model_name(args.model),
                     api_keys=_api_keys(args.api_key),
                     output_filter=BlocklistFilter(args.blocklist.split(",")) if args.blocklist else NoFilter(),
                     tracing=_tracing("serval", args))


def cmd_rank(args: argparse.Namespace) -> int:
    from serval.engine.workers import run_worker

    if not 1 <= args.rank < args.world_size:
        print(f"serval rank: --rank must be 1 to {args.world_size - 1} (rank 0 is the server)", file=sys.stderr)
        return 2
    if not args.dist_init_method.startswith("tcp://"):
        print("serval rank: --dist-init-method must be tcp://HOST:PORT", file=sys.stderr)
        return 2
    run_worker(args.rank, args.world_size, args.dist_init_method, resolve_device(args.device), args.model)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    import shlex

    import uvicorn

    from serval.cluster.router import create_router_app, spawn_replicas

    spawned = []
    try:
        if args.spawn:
            print(f"serval router: starting {args.spawn} replicas ...", file=sys.stderr, flush=True)
            spawned, urls = spawn_replicas(args.spawn, shlex.split(args.serve_args))
            args.replica = args.replica + urls
        config = from_args(RouterConfig, args, api_keys=_api_keys(args.api_key),
                           rules=_routing_rules(args.rules), tracing=_tracing("serval-router", args))
        app = create_router_app(config)
        logging.getLogger("serval.router").setLevel(min(logging.INFO, logging.getLogger().level))
        print(f"serval router: {config.policy} over {', '.join(config.replicas + config.decode)}"
              f"{' after prefill on ' + ', '.join(config.prefill) if config.prefill else ''}; serving on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False)
    finally:
        for proc in spawned:
            proc.terminate()
        for proc in spawned:
            proc.wait(60)
    return 0


def cmd_ray_serve(args: argparse.Namespace) -> int:
    import shlex

    try:
        from serval.cluster.ray_serve import run
    except ModuleNotFoundError as exc:
        if exc.name != "ray" and not (exc.name or "").startswith("ray."):
            raise
        raise ValueError("serval ray-serve needs Ray Serve: .venv/bin/pip install -e '.[ray]'") from None

    models = args.model or [DEFAULT_MODEL]
    config = from_args(RayServeConfig, args,
                       models={_model_name(m): ["--model", m, *shlex.split(args.serve_args)] for m in models},
                       rules=_routing_rules(args.rules), api_keys=_api_keys(args.api_key))
    print(f"serval ray-serve: starting {config.num_replicas} replica(s) of {', '.join(config.models)} on Ray ...",
          file=sys.stderr, flush=True)
    run(config, host=args.host, port=args.port, address=args.address)
    return 0


def _tracing(service_name: str, args: argparse.Namespace):
    if not args.otlp_traces_endpoint:
        return None
    from serval.tracing import Tracing

    return Tracing.create(service_name, endpoint=args.otlp_traces_endpoint)


def _routing_rules(path: str | None):
    """The --rules file (JSON, or YAML: a superset) as VariantRules; None without one."""
    if path is None:
        return None
    from pathlib import Path

    import yaml

    from serval.cluster.policy import VariantRules

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--rules {path}: {exc}") from None
    return VariantRules.from_dict(raw)


def _api_keys(flags: list[str] | None) -> list[str]:
    """The --api-key flags plus SERVAL_API_KEY from the environment."""
    keys = [os.environ.get("SERVAL_API_KEY", "")] + (flags or [])
    return [k for k in keys if k]


ABORTED_ANSWER_S = 5.0  # after the drain's timeout, how long the aborted requests get to send their last chunks


def _drain_on_sigterm(server, app, engine, timeout: float) -> None:
    """SIGTERM: refuse new generations at once (503), let running ones finish for ``timeout`` seconds, then abort
    those still running (each stream ends with finish_reason "abort" and [DONE]) and exit."""
    original = server.handle_exit
    abort_timer = threading.Timer(timeout, engine.abort_all)
    abort_timer.daemon = True

    def handle_exit(sig, frame):
        app.state.flags["draining"] = True
        if not abort_timer.is_alive() and not abort_timer.finished.is_set():
            abort_timer.start()
        if sig == signal.SIGTERM:
            # uvicorn's own handler re-raises a captured SIGTERM once it has shut down, which kills the process
            # (exit -15) before the engine stops; a drained SIGTERM is a clean exit.
            server.should_exit = True
        else:
            original(sig, frame)

    server.handle_exit = handle_exit


def _exit_when_engine_dies(server, engine) -> None:
    """A dead engine serves nothing again: once every open request has had its error, the server exits (non-zero)
    so that its supervisor (systemd, Kubernetes, Ray) starts a fresh one, as vLLM's does."""

    def watch() -> None:
        engine.dead.wait()
        server.should_exit = True  # uvicorn then closes the port and waits for the open responses to end

    threading.Thread(target=watch, name="serval-engine-watch", daemon=True).start()


def _model_name(model: str | None) -> str:
    from pathlib import Path

    if model is None:
        return DEFAULT_MODEL
    return Path(model).stem if Path(model).exists() else model


def cmd_models(args: argparse.Namespace) -> int:
    from serval.model.gguf_file import ARCHITECTURES as GGUF_ARCHITECTURES
    from serval.model.gguf_file import SUPPORTED_TYPES
    from serval.model.hf_config import ARCHITECTURES as HF_ARCHITECTURES
    from serval.model.registry import embedded_models

    print("Embedded models (from PyPI wheels):")
    for name, path in embedded_models().items():
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"  {name}{default}: {path if path else 'not installed'}")
    print("Also loads: a .gguf file of architecture " + ", ".join(GGUF_ARCHITECTURES)
          + " (tensor types " + ", ".join(sorted(SUPPORTED_TYPES)) + ")")
    print("            or a Hugging Face directory (config.json + *.safetensors) of " + ", ".join(HF_ARCHITECTURES))
    return 0


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default in --help, but not the non-defaults of flags that are simply unset (None, an
    off switch, an empty list): their help text says what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action)


class _ModelArgument(argparse.Action):
    """`serve MODEL`, as `vllm serve MODEL`: the same as --model (given both, they must agree)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:
            return
        if getattr(namespace, "model", None) not in (None, values):
            parser.error(f"the model is given twice: {values} and --model {namespace.model}")
        namespace.model = values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="serval", description="Serval LLM serving engine",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_verb(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=summary, formatter_class=DefaultsHelpFormatter)

    gen = add_verb("generate", "answer prompts and exit")
    gen.add_argument("prompt", nargs="+", help="a question (or, with --raw, text to continue); several run batched")
    gen.add_argument("--raw", action="store_true", help="plain completion, without the chat template")
    gen.add_argument("--system", default=None, help="system prompt")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = add_verb("chat", "interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    _engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = add_verb("serve", "OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", action=_ModelArgument,
                       help="the model, as --model gives it (an embedded model's name, a .gguf file, a directory, or "
                       "a Hugging Face name such as Qwen/Qwen2.5-0.5B-Instruct, read from the local Hugging Face "
                       "cache)")
    add_flags(serve, ListenConfig)
    add_flags(serve, ServerConfig)
    serve.add_argument("--blocklist", default=None, help="comma-separated words: the output filter ends a "
                       "stream with finish_reason content_filter when one appears")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="no per-request log line (by default one INFO line per API request, as JSON)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM")
    serve.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send OpenTelemetry spans of each generation request (OTLP/HTTP, e.g. "
                       "http://collector:4318/v1/traces; W3C traceparent honoured); off if unset")
    serve.add_argument("--engine-in-process", action="store_true",
                       help="step the engine on a thread of the server's process (default: the engine core runs in "
                       "its own process, and the server's HTTP, tokenizing and detokenizing never wait on its GIL)")
    add_flags(serve, TLSConfig)
    _engine_args(serve, kv_transfer=True)
    serve.set_defaults(func=cmd_serve)

    rank = add_verb("rank", "one rank of a model-parallel engine whose rank 0 (`serve --dist-init-method`) runs on "
                    "another machine: joins it, loads its shard of the model, follows its steps")
    rank.add_argument("--dist-init-method", required=True, metavar="tcp://HOST:PORT",
                      help="rank 0's --dist-init-method")
    rank.add_argument("--rank", type=int, required=True, help="this process's rank, 1 to world size - 1")
    rank.add_argument("--world-size", type=int, required=True,
                      help="all ranks: tensor-parallel size x pipeline-parallel size")
    rank.add_argument("--device", default=EngineConfig.device,
                      help="cpu, or cuda (rank r takes GPU r mod the machine's count); auto: cuda when torch sees a "
                      "GPU, as rank 0's --device")
    rank.add_argument("--model", default=None,
                      help="this machine's copy of the model file (default: where rank 0's model is found here)")
    rank.set_defaults(func=cmd_rank)

    router = add_verb("router", "one OpenAI-compatible front over several `serval serve` replicas")
    add_flags(router, RouterConfig)
    add_flags(router, ROUTER_LISTEN)
    router.add_argument("--spawn", type=int, default=0, metavar="N",
                        help="also start N `serval serve` replicas on free local ports (stopped with the router)")
    router.add_argument("--serve-args", default="", help="flags for the spawned replicas, as one string")
    router.add_argument("--rules", default=None, metavar="FILE",
                        help="model variants: a JSON or YAML file of aliases (mini, full) and rules that pick a "
                        "model by the model asked, a header or the prompt's length (README: routing rules)")
    router.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="send OpenTelemetry spans (OTLP/HTTP, e.g. http://collector:4318/v1/traces); off if unset")
    router.set_defaults(func=cmd_router)

    ray_serve = add_verb("ray-serve", "Serval replicas as Ray Serve deployments, routed by Serval's policy")
    ray_serve.add_argument("--model", action="append", default=[],
                           help=f"a model to serve, one deployment each (repeatable; default {DEFAULT_MODEL})")
    ray_serve.add_argument("--serve-args", default="", help="`serval serve` flags for every replica, as one string")
    add_flags(ray_serve, RayServeConfig)
    ray_serve.add_argument("--rules", default=None, metavar="FILE", help="model variants, as for `serval router`")
    ray_serve.add_argument("--address", default=None,
                           help="a Ray cluster to join (e.g. auto, or ray://head:10001); default: start one here")
    add_flags(ray_serve, ListenConfig)  # where Ray Serve's HTTP proxy listens
    ray_serve.set_defaults(func=cmd_ray_serve)

    bench = add_verb("bench", "benchmarks: a serving load against any OpenAI-compatible server, or offline")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    benchmarks = [
        ("serve", serve_benchmark.add_arguments, serve_benchmark.cmd_bench_serve,
         "streaming load against an OpenAI-compatible server: throughput, TTFT/TPOT/ITL/E2E, goodput",
         "Streaming load against an OpenAI-compatible server (Serval, vLLM, llama.cpp, ...): throughput, "
         "TTFT/TPOT/ITL/E2E percentiles, goodput under SLOs."),
        ("throughput", throughput_benchmark.add_arguments, throughput_benchmark.cmd_bench_throughput,
         "offline tokens/s of the engine on a batch of prompts, and of transformers on the same weights",
         "Offline tokens/s of the in-process engine on a batch of prompts, and of Hugging Face transformers on the "
         "same weights and prompts."),
        ("quality", quality_benchmark.add_arguments, quality_benchmark.cmd_bench_quality,
         "perplexity and greedy agreement of each weight form (dtype, quantization) against float32",
         "Perplexity of a fixed text (Python's library reference topics) and greedy agreement with the float32 "
         "dequantized reference, for each weight form, through the engine."),
    ]
    for name, add_arguments, command, summary, description in benchmarks:
        bench_verb = bench_sub.add_parser(name, formatter_class=DefaultsHelpFormatter, help=summary,
                                          description=description)
        add_arguments(bench_verb)
        bench_verb.set_defaults(func=command)

    models = add_verb("models", "list the models Serval can load")
    models.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"serval: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: stop quietly, as a shell command does
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
