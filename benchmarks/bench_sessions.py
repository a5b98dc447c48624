"""Multi-turn chat with and without conversation sessions, under traffic that cycles the KV cache.

    .venv/bin/python benchmarks/bench_sessions.py [--kv-cache-memory 0.05] [--conversations 6] [--turns 4]
        [--compare sessions|memory]

Starts `serval serve` from this checkout once per compared setup, with the same flags (a small KV cache, so that
other traffic evicts what a conversation left in the prefix cache): `--compare sessions` (the default) replays the
conversations with a `session_id` per conversation and without; `--compare memory` adds the memory hierarchy's
other parts, alone and together: a host-RAM second tier (`--kv-offload-size`), an int8 KV cache, and both with
sessions. Each conversation is replayed turn by turn (its earlier answers are the next prompt's
prefix, and the user "thinks" a few seconds between turns), two conversations at a time, while two background
clients send other long prompts. Reports, for the turns
after the first, the time to first token and the share of the prompt served from cache, side by side.

Wall-clock numbers vary between sessions: compare the two columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serval.platform_info import describe_hardware  # noqa: E402

QUESTIONS = [
    "Tell me about the history of the bicycle.", "Who invented the pedal?", "How did tyres change cycling?",
    "What about racing bicycles?", "Summarise what you said in two sentences.", "What should a beginner buy?",
]
SYSTEM = ("You are a patient teacher. Answer in plain prose, with examples, and keep each answer short. "
          "Conversation {i}: the student studies engineering and likes history. ")
BACKGROUND = "Request {i}: describe the weather, the sea, the harbour and the boats of a small town. " * 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "serval.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--disable-log-requests", "--served-model-name", "smollm2", *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serval serve exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(f"serval serve did not start; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def one_turn(client: openai.AsyncOpenAI, messages: list[dict], session: dict, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, text, usage = None, [], None
    stream = await client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, **session)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return {"ttft_s": (first or time.perf_counter()) - start, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens}


async def conversation(client, i: int, turns: int, use_session: bool, max_tokens: int,
                       think_s: float) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM.format(i=i)}]
    session = {"extra_body": {"session_id": f"bench-conv-{i}"}} if use_session else {}
    results = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        result = await one_turn(client, messages, session, max_tokens)
        messages.append({"role": "assistant", "content": result["text"]})
        await asyncio.sleep(think_s)  # the user reads and types; other traffic goes on
        results.append({"conversation": i, "turn": turn, **{k: v for k, v in result.items() if k != "text"}})
    return results


async def background(client, stop: asyncio.Event) -> int:
    sent = 0
    while not stop.is_set():
        await client.completions.create(model="smollm2", prompt=BACKGROUND.format(i=sent), max_tokens=4,
                                        temperature=0)
        sent += 1
    return sent


async def replay(url: str, args: argparse.Namespace, use_session: bool) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    stop = asyncio.Event()
    noise = [asyncio.create_task(background(client, stop)) for _ in range(2)]
    gate = asyncio.Semaphore(args.concurrency)

    async def guarded(i: int) -> list[dict]:
        async with gate:
            return await conversation(client, i, args.turns, use_session, args.max_tokens, args.think_s)

    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(guarded(i) for i in range(args.conversations)))
    elapsed = time.perf_counter() - start
    stop.set()
    background_requests = sum(await asyncio.gather(*noise))
    turns = [t for c in per_conversation for t in c]
    later = [t for t in turns if t["turn"] > 0]
    kv = httpx.get(f"{url}/debug/kv", timeout=10).json()
    return {
        "wall_s": round(elapsed, 1), "background_requests": background_requests,
        "later_turns": len(later),
        "later_ttft_ms_p50": round(1000 * statistics.median(t["ttft_s"] for t in later), 1),
        "later_ttft_ms_mean": round(1000 * statistics.mean(t["ttft_s"] for t in later), 1),
        "later_prompt_tokens": sum(t["prompt_tokens"] for t in later),
        "later_cached_tokens": sum(t["cached_tokens"] for t in later),
        "later_cached_share": round(sum(t["cached_tokens"] for t in later) /
                                    max(1, sum(t["prompt_tokens"] for t in later)), 3),
        "first_ttft_ms_p50": round(1000 * statistics.median(t["ttft_s"] for t in turns if t["turn"] == 0), 1),
        "kv_at_end": {"tier": kv["tiers"][0], "sessions": {k: v for k, v in kv["sessions"].items() if k != "kept"}},
        "turns": turns,
    }


OFFLOAD_SIZE = object()  # stands for --offload-size in a setup's flags
# Each compared setup: (name, whether the client names a session per conversation, its own serve flags).
SETUPS = {
    "sessions": [("sessions", True, []), ("no sessions", False, [])],
    "memory": [("no sessions", False, []), ("sessions", True, []),
               ("second tier", False, ["--kv-offload-size", OFFLOAD_SIZE]),
               ("int8 KV", False, ["--kv-cache-dtype", "int8"]),
               ("all three", True, ["--kv-offload-size", OFFLOAD_SIZE, "--kv-cache-dtype", "int8"])],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory", type=float, default=0.05, help="GiB (small: the traffic cycles it)")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2, help="conversations at a time")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--think-s", type=float, default=3.0, help="seconds between an answer and the next turn")
    parser.add_argument("--flags", default="", help="more `serval serve` flags for both runs")
    parser.add_argument("--compare", default="sessions", choices=sorted(SETUPS),
                        help="sessions: with and without; memory: also a second tier and an int8 KV cache")
    parser.add_argument("--offload-size", type=float, default=0.25, help="GiB of the second tier (--compare memory)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    flags = ["--kv-cache-memory", str(args.kv_cache_memory), *args.flags.split()]
    print(f"machine: {describe_hardware()}", flush=True)
    results = {"machine": describe_hardware(), "flags": flags, "runs": {}}
    setups = SETUPS[args.compare]
    for i, (name, use_session, extra) in enumerate(setups):
        extra = [args.offload_size if flag == OFFLOAD_SIZE else flag for flag in extra]
        run_flags = flags + [str(flag) for flag in extra]
        print(f"[{i + 1}/{len(setups)}] {name}: starting serval serve {' '.join(run_flags)} ...", flush=True)
        proc, url = start_server(run_flags, Path(f"/tmp/bench_sessions_{i}.log"))
        try:
            print(f"      replaying {args.conversations} conversations of {args.turns} turns ...", flush=True)
            run = asyncio.run(replay(url, args, use_session))
        finally:
            stop_server(proc)
        results["runs"][name] = run
        print(f"      turns 2+: TTFT p50 {run['later_ttft_ms_p50']} ms, {100 * run['later_cached_share']:.1f}% of "
              f"their prompt tokens from cache; {run['background_requests']} background requests", flush=True)
    runs = results["runs"]
    print(f"\n{'turns after the first':<28}" + "".join(f"{name:>22}" for name in runs))
    for label, key in (("TTFT p50 (ms)", "later_ttft_ms_p50"), ("TTFT mean (ms)", "later_ttft_ms_mean"),
                       ("prompt tokens from cache", "later_cached_share"), ("wall (s)", "wall_s")):
        print(f"{label:<28}" + "".join(f"{run[key]:>22}" for run in runs.values()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
