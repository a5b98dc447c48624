"""The EngineCore in its own process (main(), started by engine/core_client.py: CORE_COMMAND).

It connects two ipc:// sockets the front end bound: it PULLs adds and finishes, and PUSHes each step's outputs (token
ids, logprobs, finish reasons, the core's counters) back; the messages, one dataclass per kind, and their msgpack
frames are in engine/messages.py. It exits when told to, when its loop dies (after saying why), or when its parent
is gone.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import shutil
import signal
import sys
import time
import traceback

import zmq

from serval.config import EngineConfig
from serval.engine.core import EngineCore
from serval.engine.messages import (
    POLL_MS,
    AddRequests,
    CoreConnected,
    CoreDead,
    CoreFailed,
    CoreReady,
    EndSession,
    EngineCoreOutputs,
    FinishRequests,
    KVStateQuery,
    KVStateReply,
    MessageError,
    Shutdown,
    decode,
    encode,
)
from serval.errors import ModelFileError
from serval.lifetime import end_with_parent
from serval.model.model_files import check_model_files

logger = logging.getLogger(__name__)

# -- the core's process --------------------------------------------------------------------------------------------
def run_engine_core(config: EngineConfig, model_path: str, input_address: str, output_address: str,
                    parent_pid: int) -> None:
    """The core process's main: load, say ready (or why not), then take commands and step until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it stops us in order
    # The server gone (a SIGKILL too) at any phase, loading included: the kernel sends SIGHUP, and the core removes
    # the sockets' folder, which nobody else is left to remove, and exits. SIGKILL could not clean up.
    ipc_dir = os.path.dirname(input_address.removeprefix("ipc://"))
    signal.signal(signal.SIGHUP, lambda signum, frame: _exit_orphaned(ipc_dir))
    end_with_parent(parent_pid, signal.SIGHUP)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(input_address)
    results = context.socket(zmq.PUSH)
    results.connect(output_address)
    results.send(encode(CoreConnected()))
    try:
        # the front end's tokenizer is its own
        check_model_files(model_path, tokenizer=False, weights=config.load_format != "dummy")
        core = EngineCore(config, model_path)
    except BaseException as exc:  # noqa: BLE001 - the front end raises it
        bad_file = isinstance(exc, ModelFileError)
        results.send(encode(CoreFailed(str(exc) if bad_file else f"{type(exc).__name__}: {exc}", bad_file)))
        results.close(linger=5000)
        commands.close(linger=0)
        context.term()  # returns once the reason is sent (or the linger is over): the process exits right after
        return
    # The collector is off from the process's start (core_client.CORE_COMMAND) to here: while torch imports and the
    # model loads it found nothing to free and took 0.26 s of CPU. What was built is frozen (never scanned again).
    gc.freeze()
    gc.enable()
    results.send(encode(CoreReady(core.info)))
    try:
        _core_loop(core, commands, results, parent_pid)
        core.shutdown()
    except BaseException as exc:  # noqa: BLE001 - the loop died: the front end must hear why
        logger.exception("engine core loop died")
        results.send(encode(CoreDead(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    finally:
        results.close(linger=2000)
        commands.close(linger=0)
        context.term()


def _exit_orphaned(ipc_dir: str) -> None:
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(1)


def _core_loop(core: EngineCore, commands: zmq.Socket, results: zmq.Socket, parent_pid: int) -> None:
    last_busy = time.monotonic()
    while True:
        if os.getppid() != parent_pid:  # the server is gone (killed): nobody will read our outputs; checked every
            return                      # step too, where no parent-death signal exists (not Linux)
        # Holds fetched or expired give their blocks back, even while idle: the front end hears the new counts.
        freed = core.poll_kv_transfers()
        busy = core.has_unfinished_requests()
        if busy:
            last_busy = time.monotonic()
        if freed and not busy:
            results.send(encode(EngineCoreOutputs([], core.snapshot())))
        if commands.poll(0 if busy else POLL_MS):
            while True:
                try:
                    frame = commands.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                match decode(frame):  # MessageError: the loop dies and says why (CoreDead), nothing is dropped
                    case AddRequests(requests):
                        for request in requests:
                            core.add_request(request)
                    case FinishRequests(request_ids, status):
                        core.finish_requests(request_ids, status)
                    case EndSession(session_id):
                        core.end_session(session_id)
                    case KVStateQuery(token):  # answered at once, between two steps
                        results.send(encode(KVStateReply(token, core.kv_state())))
                    case Shutdown():
                        return
                    case other:
                        raise MessageError(f"the engine core takes no {type(other).__name__}")
        elif not busy:
            core.grammars.idle_for(time.monotonic() - last_busy)
            continue
        if core.has_unfinished_requests():
            results.send(encode(core.step()))
        else:  # the commands emptied the core (aborts, stops): no step follows to carry the freed blocks' counters
            results.send(encode(EngineCoreOutputs([], core.snapshot())))


def main() -> None:
    """The core process: its settings on stdin (core_client.CORE_COMMAND starts it)."""
    run_engine_core(*pickle.loads(sys.stdin.buffer.read()))
    # Its sockets are closed and its files written: the interpreter's teardown (the model's tensors freed one at a
    # time, torch's exit handlers) only delays the server's exit, by 1 s measured on two quiet cores.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
