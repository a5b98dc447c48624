"""The engine core in its own process (CoreProcessClient over ZeroMQ): the same outputs as the in-process engine
in the default configuration, aborts and stop strings free the core's blocks, a core that dies or fails to load is
reported and never waited on. The frames' round trip is checked without a model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from real_model import requires_model

import serval
from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig, SchedulerConfig
from serval.engine import core_client
from serval.engine.client import EngineDeadError
from serval.engine.core_client import CoreProcessClient
from serval.engine.messages import (
    AddRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreStats,
    decode,
    encode,
)
from serval.layers.linear import use_activation_quantization
from serval.outputs import TokenLogprobs
from serval.sampling_params import StructuredOutputsParams

NUM_BLOCKS = 64
PROMPTS = ["The capital city of France is", "def fibonacci(n):", "Once upon a time, there lived",
           "A list of fruits: apple, banana,"]
REQUESTS = [  # (prompt index, params): greedy, sampled and seeded with n, stop strings, logprobs, prompt logprobs
    (0, SamplingParams(temperature=0, max_tokens=24, logprobs=2)),
    (1, SamplingParams(temperature=0, max_tokens=24, stop=["return"])),
    (2, SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=16)),
    (3, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1)),
]


def _config() -> EngineConfig:
    """The default dtype and quantization (what `serve` runs), with a small cache."""
    return EngineConfig(max_model_len=512, cache=CacheConfig(num_blocks=NUM_BLOCKS),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512))


@pytest.fixture(scope="module")
def client():
    client = CoreProcessClient.from_config(_config())
    client.start()
    yield client
    client.shutdown()
    assert client.process.poll() is not None  # shut down means gone


async def _final(client, request_id, prompt, params):
    outputs = [out async for out in client.generate(request_id, prompt, params)]
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    return outputs[-1]


@pytest.mark.slow
@requires_model
def test_outputs_equal_the_in_process_engine_in_the_default_configuration(client, make_llm):
    config = _config()
    llm = make_llm(dtype=str(config.torch_dtype).removeprefix("torch."), num_blocks=NUM_BLOCKS, max_model_len=512,
                   activation_quantization=config.activation_quantization)
    expected = [llm.generate(PROMPTS[i], params, use_tqdm=False)[0] for i, params in REQUESTS]
    use_activation_quantization(llm.engine.model, "none")  # the shared weights back to make_llm's default

    async def run_all():
        return await asyncio.gather(*[_final(client, f"r{k}", PROMPTS[i], params)
                                      for k, (i, params) in enumerate(REQUESTS)])

    got = asyncio.run(run_all())
    for want, have in zip(expected, got):
        assert have.prompt_token_ids == want.prompt_token_ids
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in have.outputs] == \
               [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in want.outputs]
        assert [c.logprobs for c in have.outputs] == [c.logprobs for c in want.outputs]
        assert have.prompt_logprobs == want.prompt_logprobs
    assert got[1].outputs[0].finish_reason == "stop" and got[1].outputs[0].stop_reason == "return"
    assert len(got[2].outputs) == 2 and got[0].outputs[0].logprobs and got[3].prompt_logprobs
    assert got[0].metrics["first_scheduled_time"] >= got[0].metrics["arrival_time"]
    _wait_all_blocks_free(client)


@pytest.mark.slow
@requires_model
def test_an_abort_and_a_bad_request_touch_nothing_else(client):
    async def scenario():
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        keeper = asyncio.ensure_future(_final(client, "keep", PROMPTS[0], SamplingParams(temperature=0,
                                                                                           max_tokens=20)))
        seen = 0
        async for _ in client.generate("leaver", PROMPTS[1], long):
            seen += 1
            if seen == 3:
                break  # the caller leaves: the stream aborts the request in the core
        with pytest.raises(ValueError, match="vocabulary"):
            await _final(client, "bad", [10**9], long)
        with pytest.raises(ValueError, match="context"):
            await _final(client, "too-long", PROMPTS[0], SamplingParams(max_tokens=10_000))
        return await keeper

    kept = asyncio.run(scenario())
    assert kept.outputs[0].finish_reason == "length" and len(kept.outputs[0].token_ids) == 20
    stats = _wait_all_blocks_free(client)
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.slow
@requires_model
def test_a_request_the_core_cannot_take_is_refused_before_it_is_counted(client):
    """A ValueError, and no trace: not waiting, not registered. (An integer past 64 bits or a lone surrogate once
    failed in msgpack after the request was counted as sent: a queue slot taken for good.)"""
    bad = [SamplingParams(top_k=2**64, max_tokens=4), SamplingParams(stop=["\ud800"], max_tokens=4),
           SamplingParams(stop_token_ids=[10**6], max_tokens=4), SamplingParams(min_tokens=10**6, max_tokens=None),
           SamplingParams(logit_bias={2**70: 1.0}, max_tokens=4)]

    async def send_all():
        for i, params in enumerate(bad):
            with pytest.raises(ValueError):
                await client.add_request(f"unsendable-{i}", PROMPTS[0], params)
        with pytest.raises(ValueError, match="priority"):
            await client.add_request("unsendable-priority", PROMPTS[0], SamplingParams(max_tokens=4), priority=2**64)

    asyncio.run(send_all())
    assert client.snapshot().num_waiting == 0 and client.num_active_requests == 0
    assert not client.front.outputs.groups  # nothing registered on the front end's side either


@pytest.mark.slow
@requires_model
def test_every_command_crosses_to_the_core_process(client):
    """A constrained request (the core builds its grammar compiler from the model's tokenizer), a session's turn,
    KVStateQuery and EndSession, each through the process boundary (engine/messages.py) and acted on by the core."""
    async def scenario():
        choice = SamplingParams(temperature=0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        answer = await _final(client, "constrained", PROMPTS[0], choice)
        turn = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # a full block or more to keep
        prompt = "Once upon a time, in a small village by the sea, there lived"
        async for _ in client.generate("turn", prompt, turn, session_id="conv"):
            pass
        kept = await client.kv_state()
        client.end_session("conv")
        return answer, kept, await client.kv_state()

    answer, kept, ended = asyncio.run(scenario())
    assert answer.outputs[0].text in ("yes", "no")
    assert [s["session_id"] for s in kept["sessions"]["kept"]] == ["conv"]
    assert kept["sessions"]["kept"][0]["blocks"] >= 1
    assert ended["sessions"]["kept"] == []
    _wait_all_blocks_free(client)


def _wait_all_blocks_free(client, timeout: float = 10.0) -> EngineCoreStats:
    """The core frees a request's blocks when its finish arrives and sends its counters after."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.snapshot()
        if stats.num_free_blocks == stats.num_blocks or time.monotonic() > deadline:
            assert stats.num_free_blocks == stats.num_blocks, stats
            return stats
        time.sleep(0.05)


@pytest.mark.slow
@requires_model
def test_a_killed_core_fails_open_streams_and_new_requests_at_once():
    client = CoreProcessClient.from_config(_config())
    client.start()
    try:
        async def scenario():
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            stream = client.generate("victim", PROMPTS[0], params)
            await stream.__anext__()
            os.kill(client.process.pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match="exited"):
                async for _ in stream:
                    pass
            assert time.monotonic() - started < 30  # told, not left hanging
            with pytest.raises(EngineDeadError):
                await _final(client, "late", PROMPTS[0], params)

        asyncio.run(scenario())
        assert not client.is_alive and "exited" in str(client.error)
    finally:
        client.shutdown()


ORPHAN_SCRIPT = """
import asyncio, sys
import serval
from serval import SamplingParams
from serval.config import CacheConfig, EngineConfig
from serval.engine.core_client import CoreProcessClient

client = CoreProcessClient.from_config(EngineConfig(max_model_len=4096, cache=CacheConfig(num_blocks=300)))
client.start()

async def main():
    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    async for _ in client.generate("long", "Once upon a time", params):
        # the core is busy: tell the test who it is and where its sockets were, then keep going
        print(client.process.pid, client._ipc_dir, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.slow
@requires_model
@pytest.mark.parametrize("end", ["server SIGKILL", "SIGKILL to the process group", "core SIGTERM"])
def test_a_busy_core_ends_with_its_server_and_leaves_no_sockets_folder(tmp_path, end):
    """A server killed outright (SIGKILL: no shutdown) leaves its core mid-request; the core notices within a step
    that its parent is gone and exits, rather than computing thousands of tokens for nobody. The sockets' folder is
    gone from the moment the core connected, so no end of either process can leave it behind."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(Path(serval.__file__).parents[1])})
    try:
        pid, ipc_dir = server.stdout.readline().split()
        core_pid = int(pid)
        assert _alive(core_pid)
        assert not os.path.exists(ipc_dir)  # removed once connected, while the core runs
        if end == "server SIGKILL":
            server.kill()
        elif end == "SIGKILL to the process group":
            os.killpg(server.pid, signal.SIGKILL)
        else:
            os.kill(core_pid, signal.SIGTERM)
            server.kill()
        server.wait(10)
        deadline = time.monotonic() + 10
        while _alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(core_pid)
        assert not os.path.exists(ipc_dir)
    finally:
        server.kill()


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@requires_model
def test_a_core_that_cannot_load_is_an_error_naming_the_cause(monkeypatch):
    """The core process loads the model, then finds no room for a KV cache: the caller gets the core's own
    error, and the process is gone."""
    started = []
    real_popen = core_client.subprocess.Popen
    monkeypatch.setattr(core_client.subprocess, "Popen", lambda *a, **k: started.append(real_popen(*a, **k))
                        or started[-1])
    with pytest.raises(RuntimeError, match="failed to load: ValueError: .*fewer than 2 blocks"):
        CoreProcessClient.from_config(EngineConfig(cache=CacheConfig(kv_cache_memory=1e-6)))
    assert len(started) == 1 and started[0].wait(10) is not None


@pytest.mark.slow
@requires_model
def test_the_callers_start_runs_while_the_core_loads(monkeypatch):
    """`serve` imports its HTTP server while the core process loads, not before that process starts."""
    started, seen = [], []
    real_popen = core_client.subprocess.Popen
    monkeypatch.setattr(core_client.subprocess, "Popen", lambda *a, **k: started.append(real_popen(*a, **k))
                        or started[-1])
    client = CoreProcessClient.from_config(_config(), while_loading=lambda: seen.append(
        (len(started), started[0].poll())))
    try:
        assert seen == [(1, None)]  # once, the core's process started and running
    finally:
        client.shutdown()


def test_frames_round_trip():
    params = SamplingParams(temperature=0.5, top_k=5, seed=3, stop=["\n\n"], stop_token_ids=[2], max_tokens=9,
                            logit_bias={17: -100.0, 49151: 5.5}, logprobs=2, prompt_logprobs=0)
    request = EngineCoreRequest("r#1", [1, 2, 3], params, [0, 2], 9, priority=-1, group_id="r", arrival_time=12.5)
    again = decode(encode(AddRequests([request]))).requests[0]
    assert again == request and again.params.logit_bias == {17: -100.0, 49151: 5.5}

    entry = TokenLogprobs(42, -0.25, 1, {42: -0.25, 7: -1.5})
    outputs = EngineCoreOutputs(
        [EngineCoreOutput("a", [42], [entry], "stop", 2, 16, (1, [entry, entry]), 3.0, None),
         EngineCoreOutput("b", [], None, "error", None, 0, None, None, "boom")],
        EngineCoreStats(num_running=1, num_waiting=2, num_blocks=8, num_free_blocks=3, kv_cache_usage=0.625,
                        num_steps=5, num_received_requests=2))
    assert decode(encode(outputs)) == outputs


def test_the_next_front_end_removes_the_folder_of_a_start_up_killed_whole(tmp_path, monkeypatch):
    """A front end and its core SIGKILLed together before the core connected (Ray Serve stops a replica that is still
    starting by killing its process group) leave their sockets' folder, which neither can remove. A front end that
    starts removes such folders: its front end's pid is gone and the folder is a minute old. A live front end's
    folder, or one just made, stays."""
    monkeypatch.setattr(core_client.tempfile, "gettempdir", lambda: str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    minute_ago = time.time() - core_client.ORPHANED_IPC_DIR_AGE_S - 5
    folders = {name: tmp_path / f"{core_client.IPC_DIR_PREFIX}{name}" for name in
               (f"{gone.pid}-old", f"{gone.pid}-new", f"{os.getpid()}-live", "unnamed")}
    for name, folder in folders.items():
        folder.mkdir()
        (folder / "commands").touch()
        if name != f"{gone.pid}-new":
            os.utime(folder, (minute_ago, minute_ago))
    core_client.remove_orphaned_ipc_dirs()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        folders[name].name for name in (f"{gone.pid}-new", f"{os.getpid()}-live", "unnamed"))


@requires_model
def test_the_core_loads_without_the_garbage_collector_and_serves_with_it(tmp_path, monkeypatch):
    """The core's process starts with the collector off (core_client.CORE_COMMAND: while torch imports and the model
    loads it freed nothing and took 0.26 s of CPU), and turns it on, with what was built frozen, once the model is
    loaded: a core that serves for days must free cyclic garbage. The real command, with a probe that writes the
    collector's state as the core is built and as its loop starts."""
    record = tmp_path / "gc.txt"
    probe = ("import serval.engine.core_process as cp; built, loop = cp.EngineCore, cp._core_loop; "
             f"note = lambda phase: open({str(record)!r}, 'a').write(f'{{phase}} {{gc.isenabled()}} "
             "{gc.get_freeze_count() > 0}\\n'); "
             "cp.EngineCore = lambda *args: (note('loading'), built(*args))[1]; "
             "cp._core_loop = lambda *args: (note('serving'), loop(*args))[1]; main()")
    assert core_client.CORE_COMMAND[2].count("main()") == 1
    monkeypatch.setattr(core_client, "CORE_COMMAND",
                        (*core_client.CORE_COMMAND[:2], core_client.CORE_COMMAND[2].replace("main()", probe)))
    client = CoreProcessClient.from_config(_config())
    client.start()
    client.shutdown()
    assert record.read_text().splitlines() == ["loading False False", "serving True True"]
