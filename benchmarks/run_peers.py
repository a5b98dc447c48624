"""Serval against its peers on the same model and the same machine, in one run, with one ratio table.

Each server is started ALONE (never two at once: they would share the cores), waited for (/health), warmed up,
given every workload through the same code as `serval bench serve`, then stopped and waited for until it has
exited. Servers:

    serval            `serval serve` from this checkout, once per --serval NAME=FLAGS variant (default: `serval`,
                      the default flags); the first variant runs again with --no-enable-prefix-caching for the
                      shared-prefix workload
    llama.cpp         llama.cpp's own C++ llama-server on the same GGUF, 16 slots
    vllm              vLLM's CPU build on the GGUF written as a Hugging Face directory, bfloat16

`bash benchmarks/peers/setup.sh` builds the peers under ../peers, where this script looks for them by default.

    .venv/bin/python benchmarks/run_peers.py                                   # the full suite (long)
    .venv/bin/python benchmarks/run_peers.py --servers serval,llama.cpp --num-requests 2 --output-tokens 8 \\
        --input-words 40 --prefix-words 50                                     # a smoke run, under a minute
    .venv/bin/python benchmarks/run_peers.py --serval serval= --serval "serval-int8=--quantization int8"
    .venv/bin/python benchmarks/run_peers.py --servers serval,serval-no-spec --serval serval= \\
        --serval "serval-no-spec=--speculative-model none" --workloads grounded-1,grounded-16,chat-1,chat-16
    .venv/bin/python benchmarks/run_peers.py --model gemma3-270m --servers serval,llama.cpp   # another GGUF
    .venv/bin/python benchmarks/run_peers.py --model ../models/Llama-3.2-1B/Llama-3.2-1B-Q4_K_M.gguf \
        --workloads single                       # a sized model from benchmarks/make_sized_models.py
    .venv/bin/python benchmarks/run_peers.py --model ../models/Llama-3.2-1B/Llama-3.2-1B-Q8_0.gguf \
        --hf-dir ../models/Llama-3.2-1B/hf    # ... and vLLM on its bf16 directory (make_sized_models --keep-hf)

Only ratios from one run mean anything: a shared machine's speed drifts between runs.

`--paired-rounds N` runs one workload only (`--paired-workload`, one stream by default), with every server up at
once (the others idle while one is asked) and the workload run on each in turn, N rounds: each round's servers run
in the same minute, and the ratio is the median of the rounds' ratios (`paired.json`). On this VM a server alone
after another could land in a minute whose memory read half as fast. One stream sends one request a round and
compares decode tok/s (1000 / TPOT); any other workload runs whole each round and compares its first metric (mixed:
the wall, where a ratio below 1 is Serval's lead).

    .venv/bin/python benchmarks/run_peers.py --model ../models/Llama-3.2-1B/Llama-3.2-1B-Q4_K_M.gguf \
        --servers serval,llama.cpp --paired-rounds 8 --output-tokens 128
    .venv/bin/python benchmarks/run_peers.py --model ../models/Llama-3.2-1B/Llama-3.2-1B-Q4_K_M.gguf \
        --servers serval,llama.cpp --paired-rounds 3 --paired-workload mixed --num-requests 8 --output-tokens 128

Two versions of Serval, paired: `--serval-checkout NAME=DIR` runs the variant NAME from another checkout (its code
and its own CPU kernels), e.g. a worktree of the previous revision (`git worktree add ../base HEAD~1`):

    .venv/bin/python benchmarks/run_peers.py --model ../models/Llama-3.2-1B/Llama-3.2-1B-Q4_K_M.gguf \
        --serval base= --serval new= --serval-checkout base=../base --servers base,new --paired-rounds 8

The roofline: one decode step reads every weight matrix of the GGUF once (MoE: only the experts a token uses), plus
one row of the token embedding; KV-cache reads are left out (they grow with the context). The report gives those
bytes per token, a measured memory bandwidth (a multi-threaded torch sum over a 1 GiB buffer, with as many
threads as the servers get; once at the start, and again just after each one-stream row, since a shared machine's
rate drifts by half from one minute to the next), and for each one-stream row the fraction of the roofline that
row's own measure gives: decode tok/s (1000 / TPOT p50) x bytes per token / bandwidth. Serval may hold the weights
in another form than the file (e.g. bf16 from a Q4 file), so its fraction is against the file's bytes, the same
bar for every server.

`--isa avx2` runs the suite as an AVX2-only CPU (AMD EPYC Zen 2/3) would, on a machine with AVX-512: Serval's
kernels built for AVX2 (SERVAL_CPU_ISA), PyTorch, MKL and oneDNN held to AVX2 (so no native bfloat16: `--dtype
auto` takes float32), and an AVX2-only llama-server (`AVX2_PEER=1 bash benchmarks/peers/setup.sh`). vLLM is left
out there: its own kernels cannot be held to AVX2 (and on such CPUs it was the slowest peer, benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: this repository's serval, installed or not

from serval.benchmark.client import Endpoint, LoadConfig  # noqa: E402
from serval.benchmark.report import import_pyplot  # noqa: E402
from serval.benchmark.serve import ServeBenchConfig, run_serve_benchmark  # noqa: E402
from serval.benchmark.workloads import WorkloadConfig  # noqa: E402
from serval.platform_info import WAITS_SET_BY_SERVAL  # noqa: E402

MODEL_NAME = "smollm2"  # every server serves the model under this name
SLOTS = 16  # llama-server's parallel slots: the most concurrent requests any workload sends
NO_PREFIX_CACHE = "no-prefix-cache"
# The mixed workload (prefill-heavy prompts among running decodes) and its concurrency: bench_mixed_offline.py runs
# the same one without the server.
MIXED = WorkloadConfig("random", 64, (20, 600), (16, 128), seed=3)
MIXED_CONCURRENCY = 16
# What --isa sets for every server (and this process): the instruction sets an AVX2-only CPU has.
ISA_ENV = {"native": {}, "avx2": {"SERVAL_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                  "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


@dataclass
class Workload:
    """One workload of the suite, and the numbers of its summary the table compares."""

    name: str
    workload: WorkloadConfig
    concurrency: int
    metrics: list[tuple[str, str, bool]]  # (label, summary key path, higher is better)
    ignore_eos: bool = True
    chat: bool = False  # /v1/chat/completions (the model's chat template) instead of /v1/completions


def suite(args: argparse.Namespace) -> list[Workload]:
    """The issue's workloads; --num-requests, --output-tokens, --input-words and --prefix-words shrink them."""

    def sized(config: WorkloadConfig) -> WorkloadConfig:
        cap = lambda rng, limit: rng if limit is None else (min(rng[0], limit), min(rng[1], limit))  # noqa: E731
        return replace(config, num_requests=args.num_requests or config.num_requests,
                       input_words=cap(config.input_words, args.input_words),
                       output_tokens=cap(config.output_tokens, args.output_tokens),
                       prefix_words=args.prefix_words or config.prefix_words)

    tok_s = ("output tok/s", "output_throughput", True)
    workloads = [
        Workload("single", sized(WorkloadConfig("random", 4, (10, 40), (256, 256), seed=1)), 1, [tok_s]),
        Workload("decode-heavy", sized(WorkloadConfig("random", 32, (10, 40), (128, 256), seed=2)), 16, [tok_s]),
        Workload("mixed", sized(MIXED), MIXED_CONCURRENCY,
                 [("wall s", "duration_s", False), ("ITL p99 ms", "itl_ms.p99", False)]),
        # Four at a time: the first wave computes the shared prefix, the rest can reuse it.
        Workload("shared-prefix", sized(WorkloadConfig("prefix", 16, (10, 20), (32, 32), prefix_words=600, seed=4)),
                 4, [("TTFT p50 ms", "ttft_ms.p50", False)]),
    ]
    # Speculative decoding's workloads, run only when named (--workloads): chat answers that quote or edit a given
    # text (where prompt lookup guesses well) and free chat (ShareGPT), greedy, one stream and 16.
    greedy_chat = dict(ignore_eos=False, chat=True)
    spec_workloads = [
        Workload("grounded-1", sized(WorkloadConfig("grounded", 4, (80, 160), (64, 256), seed=5)), 1, [tok_s],
                 **greedy_chat),
        Workload("grounded-16", sized(WorkloadConfig("grounded", 32, (80, 160), (64, 256), seed=6)), 16, [tok_s],
                 **greedy_chat),
        Workload("chat-1", sized(WorkloadConfig("sharegpt", 4, (10, 200), (64, 256), seed=7)), 1, [tok_s],
                 **greedy_chat),
        Workload("chat-16", sized(WorkloadConfig("sharegpt", 32, (10, 200), (64, 256), seed=8)), 16, [tok_s],
                 **greedy_chat),
    ]
    if args.workloads:
        wanted = args.workloads.split(",")
        workloads = [w for w in workloads + spec_workloads if w.name in wanted]
    return workloads


@dataclass
class Server:
    name: str
    command: list[str]  # "{port}" is replaced by the port
    is_serval: bool = False
    workloads: list[str] | None = None  # None: all of them
    variant_of: str | None = None  # the no-prefix-cache run: the Serval variant it is a copy of
    env: dict = field(default_factory=dict)
    cwd: str | None = None  # a Serval variant run from another checkout (--serval-checkout): there


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(args: argparse.Namespace) -> list[Server]:
    from serval.model.registry import resolve_model_path

    serval_cmd = [sys.executable, "-m", "serval.cli", "serve", "--host", "127.0.0.1", "--port", "{port}",
                  "--served-model-name", MODEL_NAME, "--disable-log-requests"]
    if args.model:  # a file by its absolute path: a variant from another checkout starts there
        serval_cmd += ["--model", str(Path(args.model).resolve()) if Path(args.model).exists() else args.model]
    threads = str(server_threads())
    checkouts = dict(c.partition("=")[::2] for c in args.serval_checkout)
    env = {"PYTHONPATH": str(ROOT)}
    found = []
    for i, variant in enumerate(args.serval or ["serval="]):
        name, _, flags = variant.partition("=")
        checkout = checkouts.get(name)
        found.append(Server(name, serval_cmd + shlex.split(flags), is_serval=True,
                            env={"PYTHONPATH": checkout} if checkout else env, cwd=checkout))
        if i == 0 and any(w.name == "shared-prefix" for w in suite(args)):  # its only workload
            found.append(Server(f"{name}-{NO_PREFIX_CACHE}", serval_cmd + shlex.split(flags) +
                                ["--no-enable-prefix-caching"], is_serval=True, workloads=["shared-prefix"], env=env,
                                variant_of=name))
    peers = Path(args.peers)
    llama_dir = "llamacpp" if args.isa == "native" else f"llamacpp-{args.isa}"
    llama_server = Path(args.llama_server or peers / llama_dir / "bin" / "llama-server")
    if llama_server.exists():
        # Its default counts physical cores only, which can be fewer on a VM.
        found.append(Server("llama.cpp", [str(llama_server), "-m", str(resolve_model_path(args.model)), "--host",
                                          "127.0.0.1", "--port", "{port}", "-np", str(SLOTS), "-c",
                                          str(SLOTS * args.llama_ctx_per_slot), "-t", threads, "-tb", threads,
                                          "--alias", MODEL_NAME,
                                          # Its default HTTP pool is sized by the core count: on 2 cores some
                                          # of 16 concurrent streams were refused (connection errors).
                                          "--threads-http", str(2 * SLOTS)]))
    vllm_python = Path(args.vllm_python or peers / "vllm" / "bin" / "python")
    hf_dir = Path(args.hf_dir or peers / "hf")
    if args.isa != "native":
        print(f"vllm: left out with --isa {args.isa} (its kernels follow the CPU, not the flag)", flush=True)
    elif args.model and not args.hf_dir:
        print("vllm: left out (--model without --hf-dir: PEERS/hf is the embedded model, not this one)", flush=True)
    elif vllm_python.exists() and (hf_dir / "config.json").exists():
        found.append(Server("vllm", [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                                     str(hf_dir), "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", "{port}",
                                     "--served-model-name", MODEL_NAME, "--max-model-len", "4096",
                                     # On CPU: the share of RAM vLLM reserves, KV cache included. Its default (0.92)
                                     # fails at start-up when other processes hold a few GiB.
                                     "--gpu-memory-utilization", str(args.vllm_memory_fraction)]))
    if args.servers:
        wanted = args.servers.split(",")
        found = [s for s in found if s.name in wanted or s.variant_of in wanted]
    return found


def start(server: Server, port: int, log_path: Path, timeout_s: float) -> subprocess.Popen:
    """Starts the server in a process group of its own and returns once /health answers 200."""
    command = [c.replace("{port}", str(port)) for c in server.command]
    env = dict(os.environ)
    if not server.is_serval:  # a peer runs with its own OpenMP waits, not those `import serval` set here
        for name in WAITS_SET_BY_SERVAL:
            env.pop(name, None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**env, **server.env}, cwd=server.cwd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}: " + _tail(log_path))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    stop(proc)
    raise TimeoutError(f"not healthy after {timeout_s:.0f} s: " + _tail(log_path))


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after a minute; returns once it has exited."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _value(summary: dict, key_path: str) -> float | None:
    value = summary
    for key in key_path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def run_server(server: Server, workloads: list[Workload], log_dir: Path, timeout_s: float) -> dict:
    port = free_port()
    print(f"== {server.name}: starting ({shlex.join(c.replace('{port}', str(port)) for c in server.command)})",
          flush=True)
    started = time.perf_counter()
    try:
        proc = start(server, port, log_dir / f"{server.name}.log", timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        print(f"   {server.name} did not start: {exc}", flush=True)
        return {"command": server.command, "error": str(exc), "workloads": {}}
    result = {"command": server.command, "startup_s": time.perf_counter() - started, "workloads": {}}
    try:
        for w in workloads:
            if server.workloads is not None and w.name not in server.workloads:
                continue
            config = ServeBenchConfig(
                endpoint=Endpoint(base_url=f"http://127.0.0.1:{port}/v1", model=MODEL_NAME, ignore_eos=w.ignore_eos,
                                  chat=w.chat),
                workload=w.workload, load=LoadConfig(concurrency=w.concurrency, seed=w.workload.seed),
                warmup_requests=2)
            report = run_serve_benchmark(config, progress=False)
            s = report["summary"]
            result["workloads"][w.name] = {"description": report["description"], "summary": s}
            shown = ", ".join(f"{label} {_fmt(_value(s, key))}" for label, key, _ in w.metrics)
            if w.concurrency == 1:  # this row's own roofline: the memory's rate drifts from one minute to the next
                bandwidth = result["workloads"][w.name]["bandwidth"] = measure_bandwidth(server_threads())
                shown += f", bandwidth just after {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s"
            print(f"   {w.name}: {s['completed']}/{s['num_requests']} ok, {shown}", flush=True)
            for error in s["errors"]:
                print(f"   error: {error}", flush=True)
    finally:
        stop(proc)
    return result


def run_paired(server_list: list[Server], workload: Workload, rounds: int, log_dir: Path,
               timeout_s: float) -> dict[str, list[float]]:
    """``workload`` with every server up at once and run on each in turn, round after round (who goes first
    alternating): a round's requests run in the same minute, the other servers idle, so that one round's ratio
    compares like with like where the machine's memory rate drifts by half from one minute to the next (one server
    alone after another can land in another regime). Each round sends every server the same requests. Returns each
    server's paired_value per round."""
    running: dict[str, tuple[subprocess.Popen, int]] = {}
    rates: dict[str, list[float]] = {s.name: [] for s in server_list}
    try:
        for server in server_list:
            port = free_port()
            print(f"== {server.name}: starting on port {port}", flush=True)
            running[server.name] = start(server, port, log_dir / f"{server.name}.log", timeout_s), port
        for i in range(rounds):
            order = server_list if i % 2 == 0 else server_list[::-1]
            for server in order:
                requests = 1 if workload.concurrency == 1 else workload.workload.num_requests
                config = ServeBenchConfig(
                    endpoint=Endpoint(base_url=f"http://127.0.0.1:{running[server.name][1]}/v1", model=MODEL_NAME,
                                      ignore_eos=workload.ignore_eos, chat=workload.chat),
                    workload=replace(workload.workload, num_requests=requests, seed=workload.workload.seed + i),
                    load=LoadConfig(concurrency=workload.concurrency, seed=workload.workload.seed + i),
                    warmup_requests=2 if i == 0 else 0)
                summary = run_serve_benchmark(config, progress=False)["summary"]
                rates[server.name].append(paired_value(workload, summary))
            print(f"   round {i + 1}: " + ", ".join(f"{s.name} {rates[s.name][-1]:.1f}" for s in server_list)
                  + f" {paired_metric(workload)[0]}", flush=True)
    finally:
        for proc, _ in running.values():
            stop(proc)
    return rates


def paired_metric(workload: Workload) -> tuple[str, bool]:
    """What a paired round compares (label, higher is better): one stream's decode rate, else the workload's first
    metric."""
    if workload.concurrency == 1:
        return "decode tok/s", True
    label, _, higher_is_better = workload.metrics[0]
    return label, higher_is_better


def paired_value(workload: Workload, summary: dict) -> float:
    """A round's value of paired_metric: 1000 / TPOT p50 for one stream, else the first metric's."""
    if workload.concurrency == 1:
        tpot = _value(summary, "tpot_ms.p50")
        return 1000.0 / tpot if tpot else float("nan")
    value = _value(summary, workload.metrics[0][1])
    return float("nan") if value is None else value


def paired_ratios(rates: dict[str, list[float]], base: str) -> dict[str, dict]:
    """Per server: the median of its rounds' values (paired_value), and the median over rounds of its value / base's
    in the same round (a ratio of medians would pair a fast minute of one with a slow minute of the other)."""
    out = {}
    for name, values in rates.items():
        ratios = [v / b for v, b in zip(values, rates[base]) if b == b and v == v and b > 0]
        out[name] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                     f"ratio_to_{base}": statistics.median(ratios) if ratios else None,
                     "round_ratios": ratios}
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def server_threads() -> int:
    """The threads every server gets: the cores this process may use (affinity), not the machine's count."""
    return len(os.sched_getaffinity(0))


def gguf_bytes_per_token(path: Path) -> dict:
    """The bytes of a GGUF's tensors one decode step reads per token: every tensor, the experts' tensors at
    expert_used_count / expert_count of their size, and one row of the token embedding (all of it again when it is
    the tied output matrix). KV-cache reads are not counted; ``kv_bytes_per_position`` (at f16) gives them per
    token of context."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key: str) -> int | None:
        f = reader.get_field(key)
        return None if f is None else int(f.parts[f.data[0]][0])

    arch = bytes(reader.get_field("general.architecture").parts[-1]).decode()
    experts, used = field(f"{arch}.expert_count"), field(f"{arch}.expert_used_count")
    total = weights = 0
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:
        size = int(t.n_bytes)
        weights += size
        if t.name == "token_embd.weight":
            rows = int(t.shape[-1])  # GGUF lists dimensions innermost first: (hidden, vocab)
            size = size // rows + (size if "output.weight" not in names else 0)
        elif "_exps." in t.name and experts and used:
            size = size * used // experts
        total += size
    layers, kv_heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv")
    heads, hidden = field(f"{arch}.attention.head_count"), field(f"{arch}.embedding_length")
    head_dim = field(f"{arch}.attention.key_length") or (hidden // heads if hidden and heads else None)
    kv = 2 * layers * kv_heads * head_dim * 2 if layers and kv_heads and head_dim else None
    return {"file": str(path), "architecture": arch, "tensor_bytes": weights, "bytes_per_token": total,
            "kv_bytes_per_position": kv, "kv_reads": "excluded"}


def measure_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> dict:
    """Memory read bandwidth: the best of a few multi-threaded torch sums over a buffer far larger than the caches,
    on ``threads`` threads (the servers' count)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        buffer.sum()  # pages touched, threads started
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - started)
        del buffer
    finally:
        torch.set_num_threads(saved)
    return {"bytes_per_s": int(gib * 2**30) / best, "buffer_gib": gib, "threads": threads,
            "method": "torch float32 sum, best of 5"}


def roofline_rows(results: dict, workloads: list[Workload], server_list: list[Server], per_token: dict,
                  bandwidth: dict) -> list[dict]:
    """For each one-stream workload and server: decode tok/s (1000 / TPOT p50) and its share of the bandwidth
    roofline (bandwidth / bytes per token), against the bandwidth measured just after that row (``bandwidth``, the
    run's first measure, where there is none)."""
    rows = []
    for w in workloads:
        if w.concurrency != 1:
            continue
        for s in server_list:
            result = results[s.name]["workloads"].get(w.name, {})
            tpot = _value(result.get("summary", {}), "tpot_ms.p50")
            if tpot:
                measured = result.get("bandwidth", bandwidth)["bytes_per_s"]
                roofline = measured / per_token["bytes_per_token"]
                rows.append({"workload": w.name, "server": s.name, "decode_tok_s": 1000 / tpot,
                             "bandwidth_bytes_per_s": measured, "roofline_tok_s": roofline,
                             "fraction": 1000 / tpot / roofline})
    return rows


def print_roofline(per_token: dict, bandwidth: dict, rows: list[dict]) -> None:
    kv = per_token["kv_bytes_per_position"]
    print(f"\nroofline: {per_token['bytes_per_token'] / 1e6:.1f} MB read per token ({per_token['file']}; KV reads "
          f"excluded{f', {kv / 1e3:.0f} kB more per token of context at f16' if kv else ''}), bandwidth "
          f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s ({bandwidth['threads']} threads): "
          f"{bandwidth['bytes_per_s'] / per_token['bytes_per_token']:.1f} tok/s at most")
    for row in rows:
        print(f"   {row['workload']:<14}{row['server']:<28}{row['decode_tok_s']:8.1f} tok/s decode  "
              f"{100 * row['fraction']:5.1f}% of the roofline at {row['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
              f"(measured just after the row)")


def ratio_table(results: dict, workloads: list[Workload], server_list: list[Server]) -> list[dict]:
    """One row per (workload, metric): every server's value, and each Serval variant's ratio to the best peer
    (above 1: Serval is better, whichever way the metric points)."""
    rows = []
    for w in workloads:
        for label, key, higher_is_better in w.metrics:
            values = {s.name: _value(results[s.name]["workloads"].get(w.name, {}).get("summary", {}), key)
                      for s in server_list}
            peer_values = [v for s in server_list if not s.is_serval and (v := values[s.name]) is not None]
            best_peer = (max if higher_is_better else min)(peer_values) if peer_values else None
            ratios = {}
            for s in server_list:
                v = values[s.name]
                if s.is_serval and v and best_peer:
                    ratios[s.name] = v / best_peer if higher_is_better else best_peer / v
            rows.append({"workload": w.name, "metric": label, "higher_is_better": higher_is_better,
                         "values": values, "best_peer": best_peer, "ratio_to_best_peer": ratios})
    return rows


def print_table(rows: list[dict], server_list: list[Server]) -> None:
    names = [s.name for s in server_list]
    width = max([16, *(len(n) + 2 for n in names)])
    print(f"\n{'workload (metric)':<32}" + "".join(f"{n:>{width}}" for n in names))
    for row in rows:
        cells = []
        for n in names:
            v = row["values"][n]
            ratio = row["ratio_to_best_peer"].get(n)
            cells.append(_fmt(v) + (f" ({ratio:.2f}x)" if ratio else ""))
        print(f"{row['workload'] + ' (' + row['metric'] + ')':<32}" + "".join(f"{c:>{width}}" for c in cells))
    print("(Nx): the Serval variant against the best peer; above 1 is better for Serval, whichever way the metric "
          "points")


def plot(rows: list[dict], server_list: list[Server], machine: str, path: Path) -> None:
    """One panel per (workload, metric), a bar per server."""
    plt = import_pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        names = [s.name for s in server_list if row["values"][s.name] is not None]
        colors = ["tab:orange" if next(s for s in server_list if s.name == n).is_serval else "tab:blue"
                  for n in names]
        ax.bar(range(len(names)), [row["values"][n] for n in names], color=colors)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        better = "higher" if row["higher_is_better"] else "lower"
        ax.set_title(f"{row['workload']}\n{row['metric']} ({better} is better)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(machine, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default=str(ROOT.parent / "peers"), help="where benchmarks/peers/setup.sh "
                        "put the peers")
    parser.add_argument("--model", default=None,
                        help="an embedded model's name or a GGUF file (e.g. one benchmarks/make_sized_models.py "
                        "made), for Serval and llama.cpp (default: the embedded default); vLLM runs on --hf-dir, "
                        "and is left out when --model is given without it")
    parser.add_argument("--llama-server", default=None,
                        help="llama-server binary (default: PEERS/llamacpp/bin; with --isa avx2, llamacpp-avx2)")
    parser.add_argument("--isa", choices=sorted(ISA_ENV), default="native",
                        help="avx2: run every server as on an AVX2-only CPU (see above)")
    parser.add_argument("--vllm-python", default=None, help="python of the vLLM venv (default: PEERS/vllm/bin)")
    parser.add_argument("--hf-dir", default=None, help="the model as a Hugging Face directory, for vLLM (default: "
                        "PEERS/hf, the embedded model; with --model, e.g. the hf/ of make_sized_models.py --keep-hf)")
    parser.add_argument("--serval", action="append", default=None, metavar="NAME=FLAGS",
                        help="a Serval variant: its name and `serval serve` flags, e.g. 'serval-int8=--quantization "
                        "int8' (repeatable; default: serval=)")
    parser.add_argument("--serval-checkout", action="append", default=[], metavar="NAME=DIR",
                        help="run the Serval variant NAME from another checkout of Serval (e.g. a git worktree of an "
                        "earlier revision: its own code and CPU kernels), to pair two versions (repeatable)")
    parser.add_argument("--servers", default=None, help="comma-separated server names to run (default: all found)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated: single, decode-heavy, mixed, shared-prefix (default: these four); "
                        "speculative decoding's: grounded-1, grounded-16, chat-1, chat-16")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per workload (smaller: faster)")
    parser.add_argument("--output-tokens", type=int, default=None, help="caps every workload's output lengths")
    parser.add_argument("--input-words", type=int, default=None, help="caps every workload's prompt lengths")
    parser.add_argument("--prefix-words", type=int, default=None, help="the shared-prefix workload's prefix length")
    parser.add_argument("--llama-ctx-per-slot", type=int, default=2048,
                        help="llama-server context per slot; -c is 16 times this")
    parser.add_argument("--vllm-memory-fraction", type=float, default=0.3,
                        help="vLLM's --gpu-memory-utilization: on CPU, the share of RAM it reserves")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument("--paired-rounds", type=int, default=None,
                        help="instead of the workloads: --paired-workload with every server up at once, run on each "
                        "in turn, this many rounds (run_paired); for ratios on a machine whose memory rate drifts")
    parser.add_argument("--paired-workload", default="single",
                        help="the workload --paired-rounds runs (single: one request a round, decode tok/s; others "
                        "whole, their first metric)")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"),
                        help="peers.json, peers.png and the servers' logs go here")
    args = parser.parse_args(argv)
    if args.paired_rounds is not None and args.paired_rounds < 1:
        parser.error(f"--paired-rounds must be at least 1, not {args.paired_rounds}")
    named = suite(argparse.Namespace(**{**vars(args), "workloads": args.paired_workload}))
    if [w.name for w in named] != [args.paired_workload]:  # one workload of the suite, not a list
        parser.error(f"--paired-workload {args.paired_workload!r}: not a workload of the suite")
    for checkout in args.serval_checkout:
        name, _, directory = checkout.partition("=")
        if not (Path(directory) / "serval" / "__init__.py").is_file():
            parser.error(f"--serval-checkout {checkout!r}: expected NAME=DIR, DIR a checkout of Serval")
    return args


def main() -> None:
    args = parse_args()

    os.environ.update(ISA_ENV[args.isa])  # before anything asks torch what the CPU can do
    from serval.model.registry import resolve_model_path
    from serval.platform_info import cpu_capability, cpu_model, describe_hardware

    workloads = suite(args)
    server_list = servers(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = describe_hardware() + ("" if args.isa == "native" else f", held to {args.isa.upper()} (--isa)")
    cpu = {"model": cpu_model(), "capability": cpu_capability()}
    print(f"machine: {machine}", flush=True)
    print(f"cpu: {cpu['model']}, capability {cpu['capability']}", flush=True)
    model_path = resolve_model_path(args.model)
    per_token = gguf_bytes_per_token(model_path) if model_path.suffix == ".gguf" else None
    bandwidth = measure_bandwidth(server_threads())
    print(f"memory bandwidth: {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s ({bandwidth['method']}, "
          f"{bandwidth['threads']} threads)", flush=True)
    print("servers: " + ", ".join(s.name for s in server_list), flush=True)
    if args.paired_rounds:
        (paired_workload,) = suite(argparse.Namespace(**{**vars(args), "workloads": args.paired_workload}))
        server_list = [s for s in server_list if s.variant_of is None]
        rates = run_paired(server_list, paired_workload, args.paired_rounds, out_dir, args.startup_timeout)
        base = "llama.cpp" if "llama.cpp" in rates else server_list[-1].name
        paired = paired_ratios(rates, base)
        label, higher_is_better = paired_metric(paired_workload)
        print(f"\n{paired_workload.name}, {args.paired_rounds} paired rounds, {label}: median (min-max), "
              f"median of the rounds' ratios to {base} ({'higher' if higher_is_better else 'lower'} is better)")
        for name, row in paired.items():
            ratio = row[f"ratio_to_{base}"]
            print(f"   {name:<24}{row['median']:7.1f} ({row['min']:.1f}-{row['max']:.1f})   "
                  + (f"{ratio:.3f}x" if ratio is not None else "-"))
        report = {"machine": machine, "cpu": cpu, "model": str(model_path), "workload_name": paired_workload.name,
                  "workload": asdict(paired_workload.workload), "concurrency": paired_workload.concurrency,
                  "metric": label, "higher_is_better": higher_is_better, "paired_rounds": args.paired_rounds,
                  "rates": rates, "paired": paired, "bandwidth": bandwidth}
        (out_dir / "paired.json").write_text(json.dumps(report, indent=2))
        print(f"wrote {out_dir / 'paired.json'}")
        return
    results = {s.name: run_server(s, workloads, out_dir, args.startup_timeout) for s in server_list}
    rows = ratio_table(results, workloads, server_list)
    print_table(rows, server_list)
    roofline = roofline_rows(results, workloads, server_list, per_token, bandwidth) if per_token else []
    if per_token:
        print_roofline(per_token, bandwidth, roofline)
    report = {"machine": machine, "cpu": cpu, "model": str(model_path),
              "workloads": {w.name: {"workload": asdict(w.workload), "concurrency": w.concurrency}
                            for w in workloads},
              "servers": results, "table": rows, "bytes_per_token": per_token, "bandwidth": bandwidth,
              "roofline": roofline}
    (out_dir / "peers.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out_dir / 'peers.json'}")
    try:
        plot(rows, server_list, machine, out_dir / "peers.png")
        print(f"wrote {out_dir / 'peers.png'}")
    except ValueError as exc:
        print(f"no plot: {exc}")


if __name__ == "__main__":
    main()
