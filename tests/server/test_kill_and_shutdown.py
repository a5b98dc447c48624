"""A server's ends: its engine killed, SIGTERM at the shutdown timeout, SIGTERM and SIGKILL at every phase, a port
already taken. Each test starts (and ends) its own `serval serve` process; nothing of its process tree, and none of its
/tmp/serval-core-* folders, may outlive it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from serverproc import SERVAL, Server, free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
GONE_WITHIN_S = 20.0  # a liveness deadline on two busy cores: the processes end within seconds
LONG = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


# -- the process tree, read from /proc -------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every process below ``root`` now: pid -> start time (a pid reused later is not the same process)."""
    children: dict[int, list[int]] = {}
    starts = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[1], []).append(int(entry))
            starts[int(entry)] = stat[2]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def running(processes: dict[int, int]) -> list[int]:
    """Those of ``processes`` still running (a zombie has ended: only its exit status is left)."""
    alive = []
    for pid, start in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == start and stat[0] != "Z":
            alive.append(pid)
    return alive


def ipc_dirs(pid: int) -> set[str]:
    """The /tmp/serval-core-* folders whose sockets process ``pid`` holds (its engine core's ZeroMQ sockets)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:  # a file the process closed since the listing (one starting up opens and closes many) is skipped
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    dirs = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and "serval-core-" in parts[7]:
            dirs.add(os.path.dirname(parts[7]))
    return dirs


def core_pid(server: Server) -> int | None:
    """The engine core's process: the server's child running serval.engine.core_process."""
    for pid in descendants(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"serval.engine.core_process" in cmdline:
            return pid
    return None


def assert_nothing_left(tree: dict[int, int], dirs: set[str]) -> None:
    assert wait_for(lambda: not running(tree), timeout=GONE_WITHIN_S), f"still running: {running(tree)}"
    assert wait_for(lambda: not any(os.path.exists(d) for d in dirs), timeout=GONE_WITHIN_S), dirs


# -- SSE ------------------------------------------------------------------------------------------------------------
def sse_events(lines) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


class Streams:
    """``count`` streamed completions on threads, each recording its SSE events (or the transport error that cut
    it), plus one request that is not streamed."""

    def __init__(self, server: Server, count: int, non_streamed: bool = False) -> None:
        self.events: list[list] = [[] for _ in range(count)]
        self.errors: list[BaseException | None] = [None] * count
        self.started = [threading.Event() for _ in range(count)]
        self.plain: httpx.Response | BaseException | None = None
        self.threads = [threading.Thread(target=self._stream, args=(server, i), daemon=True) for i in range(count)]
        if non_streamed:
            self.threads.append(threading.Thread(target=self._plain, args=(server,), daemon=True))
        for t in self.threads:
            t.start()

    def _stream(self, server: Server, i: int) -> None:
        body = {**LONG, "prompt": f"Story {i}: once upon a time", "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    self.events[i].extend(sse_events([line]))
                    self.started[i].set()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.errors[i] = exc
        finally:
            self.started[i].set()

    def _plain(self, server: Server) -> None:
        try:
            self.plain = httpx.post(f"{server.url}/v1/completions", json={**LONG, "prompt": "A plain tale:"},
                                    timeout=300)
        except BaseException as exc:  # noqa: BLE001
            self.plain = exc

    def wait_started(self, timeout: float = 120) -> None:
        for event in self.started:
            assert event.wait(timeout)
        assert not any(self.errors), self.errors

    def join(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a response never ended"


_started: list[Server] = []


@pytest.fixture(autouse=True)
def _stop_what_a_test_started():
    """A failed test still leaves no server behind (each test ends its own; this is for the failures)."""
    yield
    while _started:
        server = _started.pop()
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def start(tmp_path: Path, name: str, *args: str, port: int | None = None) -> Server:
    server = Server([*args], tmp_path / f"{name}.log", **({"port": port} if port else {}))
    _started.append(server)
    return server.start()


# -- the engine dies ------------------------------------------------------------------------------------------------
def _fault_hook(tmp_path: Path) -> tuple[dict, Path]:
    """For the in-process engine: a sitecustomize that makes the step loop raise once ``trigger`` exists."""
    hook = tmp_path / "hook"
    hook.mkdir()
    trigger = tmp_path / "kill-the-step-loop"
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('SERVAL_TEST_STEP_FAULT'):\n"
        "    import serval.engine.engine as engine\n"
        "    step = engine.LLMEngine.step\n"
        "    def failing_step(self):\n"
        "        if os.path.exists(os.environ['SERVAL_TEST_STEP_FAULT']):\n"
        "            raise RuntimeError('injected step fault')\n"
        "        return step(self)\n"
        "    engine.LLMEngine.step = failing_step\n")
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "SERVAL_TEST_STEP_FAULT": str(trigger)}, trigger


@pytest.mark.parametrize("engine", ["core-process", "in-process"])
def test_a_dead_engine_ends_every_response_with_an_error_then_the_server_exits(tmp_path, monkeypatch, engine):
    """SIGKILL of the engine core (or an exception in the in-process step loop) under 8 live streams and one
    request that is not streamed: each stream's last events are an error event and [DONE], the other gets a 5xx
    error object, and the server exits non-zero (its supervisor restarts it) with one line saying why."""
    if engine == "in-process":
        env, trigger = _fault_hook(tmp_path)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        server = start(tmp_path, engine, "--engine-in-process")
    else:
        server = start(tmp_path, engine)
    server.wait_ready()
    tree, dirs = descendants(server.proc.pid), ipc_dirs(server.proc.pid)
    streams = Streams(server, 8, non_streamed=True)
    streams.wait_started()

    def all_in_the_engine() -> bool:  # the non-streamed request too, running or waiting
        state = httpx.get(f"{server.url}/engine/state", timeout=10).json()
        return state["num_running"] + state["num_waiting"] == 9

    assert wait_for(all_in_the_engine, timeout=60)
    if engine == "in-process":
        trigger.touch()
    else:
        assert dirs, "the core's sockets are not where expected"
        os.kill(core_pid(server), signal.SIGKILL)
    streams.join()

    for i, events in enumerate(streams.events):
        assert streams.errors[i] is None, f"stream {i} was cut: {streams.errors[i]!r}"
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_dead" and error["message"], error
    assert isinstance(streams.plain, httpx.Response), streams.plain
    assert streams.plain.status_code >= 500, streams.plain.text
    assert streams.plain.json()["error"]["type"] == "server_error"

    assert server.proc.wait(GONE_WITHIN_S) != 0
    log = server.log()
    assert "exiting with code 1: the engine died" in log, log[-3000:]
    assert "Traceback" not in log.split("exiting with code 1")[-1]
    assert_nothing_left(tree, dirs)


# -- SIGTERM -------------------------------------------------------------------------------------------------------
def test_sigterm_at_the_shutdown_timeout_aborts_each_stream_with_a_final_chunk(tmp_path):
    """Streams still running when --shutdown-timeout passes end with finish_reason "abort" and [DONE]; no
    traceback in the log; the server exits 0 and nothing of it is left."""
    server = start(tmp_path, "drain", "--shutdown-timeout", "2").wait_ready()
    tree, dirs = descendants(server.proc.pid), ipc_dirs(server.proc.pid)
    streams = Streams(server, 4)
    streams.wait_started()
    server.proc.send_signal(signal.SIGTERM)
    streams.join()
    for i, events in enumerate(streams.events):
        assert streams.errors[i] is None, f"stream {i} was cut: {streams.errors[i]!r}"
        assert events[-1] == "[DONE]"
        choices = [c for e in events[:-1] for c in e["choices"]]
        assert choices[-1]["finish_reason"] == "abort", events[-3:]
        assert all(c["finish_reason"] is None for c in choices[:-1])
    assert server.proc.wait(GONE_WITHIN_S) == 0
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert_nothing_left(tree, dirs)


def test_sigterm_exits_without_waiting_for_requests_still_arriving(tmp_path):
    """A request whose body is still arriving, one whose head is, and an idle keep-alive connection do not hold
    the exit: with a 30 s drain and a 120 s read limit, the server ends seconds after its last stream. (It used to
    wait for them until uvicorn's graceful timeout, 35 s here: the half-sent body kept it.)"""
    server = start(tmp_path, "arriving", "--shutdown-timeout", "30", "--request-read-timeout", "120").wait_ready()
    tree, dirs = descendants(server.proc.pid), ipc_dirs(server.proc.pid)
    half_body = socket.create_connection(("127.0.0.1", server.port))
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\": ")
    half_head = socket.create_connection(("127.0.0.1", server.port))
    half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    idle = socket.create_connection(("127.0.0.1", server.port))
    idle.settimeout(30)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b'{"status":"ok"}'):  # the head and the body may come in two reads
        answer += idle.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200")
    body = {**LONG, "max_tokens": 16, "prompt": "A short story:", "stream": True}
    done = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        next(lines)  # the stream runs
        server.proc.send_signal(signal.SIGTERM)
        done += [line for line in lines if line == "data: [DONE]"]
    assert done, "the running stream did not finish"  # it finishes whole: the drain has 30 s
    assert server.proc.wait(GONE_WITHIN_S) == 0, server.log()[-3000:]
    for sock in (half_body, half_head, idle):
        sock.settimeout(5)
        assert sock.recv(4096) == b""  # closed by the server, not left for the kernel to reset
        sock.close()
    assert_nothing_left(tree, dirs)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("phase", ["start-up", "idle", "load"])
def test_no_process_or_folder_outlives_the_server(tmp_path, phase, sig):
    if phase == "load" and sig == signal.SIGTERM:
        pytest.skip("test_sigterm_at_the_shutdown_timeout_aborts_each_stream_with_a_final_chunk")
    server = start(tmp_path, f"{phase}-{sig.name}", "--shutdown-timeout", "2")
    if phase == "start-up":  # the engine core is loading: the server is not healthy yet
        assert wait_for(lambda: core_pid(server) and ipc_dirs(server.proc.pid), timeout=120)
    else:
        server.wait_ready()
    tree, dirs = descendants(server.proc.pid), ipc_dirs(server.proc.pid)
    assert tree and dirs
    streams = Streams(server, 3) if phase == "load" else None
    if streams:
        streams.wait_started()
    server.proc.send_signal(sig)
    code = server.proc.wait(GONE_WITHIN_S)
    assert code != 0 if sig == signal.SIGKILL or phase == "start-up" else code == 0, server.log()[-3000:]
    assert_nothing_left(tree, dirs)
    if phase == "start-up":
        assert "engine ready" not in server.log()


# -- the port ------------------------------------------------------------------------------------------------------
def test_a_port_in_use_fails_at_once_without_loading(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.Popen([str(SERVAL), "serve", "--port", str(port)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        children_seen = set()
        while proc.poll() is None and time.monotonic() - started < 60:
            children_seen |= set(descendants(proc.pid))
            time.sleep(0.05)
        out = proc.communicate(timeout=10)[0]
    assert proc.returncode not in (0, None)
    assert not children_seen, "an engine core was started"
    assert "loading" not in out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "in use" in lines[0], out


def test_the_port_is_taken_before_the_model_loads(tmp_path):
    """A second server on the port of one that is still loading fails at once; the first serves once ready."""
    port = free_port()
    server = start(tmp_path, "first", port=port)
    assert wait_for(lambda: core_pid(server), timeout=120)
    second = subprocess.run([str(SERVAL), "serve", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert second.returncode != 0 and f":{port}" in second.stderr and "loading" not in second.stderr
    assert server.proc.poll() is None
    server.wait_ready()
    server.stop()
