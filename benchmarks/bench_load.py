"""Start-up and memory of a server on a model file: seconds from the command to its first answered request, and the
peak resident memory of its processes (Serval: the HTTP server's and the engine core's), beside the file's size.
Serval and llama.cpp's llama-server on the same GGUF, each alone, one after the other.

    .venv/bin/python benchmarks/bench_load.py                                   # the embedded model
    .venv/bin/python benchmarks/bench_load.py --model FILE.gguf --model OTHER.gguf --llama-server PATH

The issue's budget: a GGUF served in its file's size + the KV cache + 1 GB at most, started in at most 2x
llama.cpp's time. Serval's KV cache on the CPU is --kv-cache-memory (1 GiB by default), llama-server's is its
context (-c) times the model's KV bytes per token.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: this repository's serval, installed or not

from serval.model.registry import resolve_model_path  # noqa: E402
from serval.platform_info import cpu_capability, cpu_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> dict[int, float]:
    """VmHWM of ``pid`` and every process below it, MiB."""
    found, todo = {}, [pid]
    while todo:
        current = todo.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    found[current] = int(line.split()[1]) / 1024
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(child) for child in children)
    return found


def first_answer(command: list[str], port: int, model_name: str, timeout_s: float, log: Path) -> dict:
    """Starts ``command``, sends a one-token completion until one is answered; returns the seconds that took and
    the peak memory of the process tree, then stops it."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        body = {"model": model_name, "prompt": "Hello", "max_tokens": 1}
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {proc.returncode}: see {log}")
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"{command[0]} answered nothing in {timeout_s} s: see {log}")
            try:
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
                if reply.status_code == 200 and reply.json().get("choices"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        seconds = time.perf_counter() - start
        peaks = peak_rss_mib(proc.pid)
        return {"startup_s": seconds, "peak_rss_mib": max(peaks.values()), "peak_rss_all_mib": sum(peaks.values())}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None,
                        help="a GGUF file or an embedded model's name (repeatable; default: the embedded default)")
    parser.add_argument("--llama-server", default=str(ROOT.parent / "peers" / "llamacpp" / "bin" / "llama-server"))
    parser.add_argument("--serval-flags", default="", help="extra flags for `serval serve`")
    parser.add_argument("--llama-ctx", type=int, default=8192,
                        help="llama-server's -c, its KV cache in tokens (8192 tokens of an 8B: 1 GiB, Serval's "
                             "default KV cache on the CPU)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load.json"))
    args = parser.parse_args()
    models = [resolve_model_path(m) for m in args.model or [None]]  # an embedded name, a file, a directory
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_model()}, {cpu_capability()}, {os.cpu_count()} cores", flush=True)
    rows = []
    for model in models:
        size_mib = model.stat().st_size / 2**20
        servers = {"serval": [sys.executable, "-m", "serval.cli", "serve", "--model", str(model),
                              "--served-model-name", "m", *args.serval_flags.split()]}
        if Path(args.llama_server).exists():
            servers["llama.cpp"] = [args.llama_server, "-m", str(model), "--alias", "m", "-np", "16",
                                    "-c", str(args.llama_ctx)]
        for name, command in servers.items():
            port = free_port()
            command = [*command, "--host", "127.0.0.1", "--port", str(port)]
            print(f"{model.name}: starting {name} ...", flush=True)
            result = first_answer(command, port, "m", args.timeout, out.parent / f"load-{name}-{model.stem}.log")
            row = {"model": model.name, "file_mib": round(size_mib), "server": name, **result}
            rows.append(row)
            print(f"  {name}: first answer in {result['startup_s']:.1f} s, peak RSS {result['peak_rss_mib']:.0f} MiB "
                  f"(all its processes {result['peak_rss_all_mib']:.0f})", flush=True)
    print("\n| model | file MiB | server | first answer, s | peak RSS, MiB (largest process) | all processes, MiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['file_mib']} | {row['server']} | {row['startup_s']:.1f} | "
              f"{row['peak_rss_mib']:.0f} | {row['peak_rss_all_mib']:.0f} |")
    out.write_text(json.dumps({"cpu": cpu_model(), "capability": cpu_capability(), "rows": rows}, indent=1))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
