"""One run that takes the figures of GPU serving (issue 33): the machine and its measured memory bandwidth, Serval's
offline tokens/s at several stream counts (one stream also as a share of the bandwidth roofline) beside Hugging Face
transformers on the same weights (and Serval's with seeded sampling at a few), the time to first token of long
prompts and decoding at a long context, the server at 1 and 16 streams, and a torch-profiler summary of one decode
step. A model at the sizes people serve needs no download: a config directory (benchmarks/configs/Llama-3.1-8B)
with --engine-arg load_format=dummy. Runs on the CPU too (at small sizes), which is how a test keeps it working.

    python benchmarks/bench_gpu.py --out DIR [--model M] [--device cuda] [--dtype bfloat16] \
        [--streams 1,16,64,256] [--sampled-streams 1,64] [--tokens 128] \
        [--ttft-prompts 4096,16384] [--long-context 32768] [--bandwidth-mib MIB] \
        [--skip transformers,server,profile,sampled,ngram,long] \
        [--engine-arg KEY=VALUE ...] [--compare-engine-arg KEY=VALUE ...]

Prints a markdown report to stdout (progress goes to stderr) and writes it, with the figures as JSON, to DIR. Every
phase has a time cap; a phase that fails or runs out of time puts its error in the report and the run goes on, and
the exit code is 1 if any did. benchmarks/README.md ("On a GPU: bench_gpu") says what each figure means.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.autograd import DeviceType

from serval.benchmark.workloads import prose
from serval.config import EngineConfig
from serval.flags import add_flags, from_args
from serval.platform_info import describe_hardware
from serval.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
PHASES = ("offline", "sampled", "long", "ngram", "profile", "compare", "transformers", "server")
SKIPPABLE = ("transformers", "server", "profile", "sampled", "ngram", "long")
# Seconds each phase may take, model load included; together under 5 minutes (the optional compare phase and the
# long phase, which only an 8B run's sizes fill, aside). A
# phase past its cap stops at the next step (or generate's max_time, or a request's timeout) and reports what it
# measured until then.
PHASE_CAP_S = {"offline": 75.0, "sampled": 15.0, "long": 90.0, "ngram": 20.0, "profile": 30.0, "compare": 90.0,
               "transformers": 80.0, "server": 75.0}
PROGRESS_EVERY_S = 5.0
SERVER_MODEL_NAME = "bench"
# The sampled phase's requests: a chat server's usual settings, each request seeded with its index.
SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.8, 0.95
# The host's calls that start work on the GPU: a kernel each, or a whole captured CUDA graph.
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")


class PhaseTimeout(Exception):
    """A phase ran past its cap."""


@dataclass
class Run:
    """What the run measured so far; ``errors`` maps a phase to why it failed."""

    args: argparse.Namespace
    started: float = field(default_factory=time.monotonic)
    results: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    def progress(self, message: str) -> None:
        print(f"[bench_gpu {time.monotonic() - self.started:6.1f} s] {message}", file=sys.stderr, flush=True)

    def phase(self, name: str, body, *args) -> object:
        """Runs one phase under its cap; an exception becomes the phase's error and the run goes on."""
        cap_s = PHASE_CAP_S[name] * self.args.cap_scale
        deadline = time.monotonic() + cap_s
        self.progress(f"{name}: start (cap {cap_s:.0f} s)")
        try:
            return body(self, deadline, *args)
        except Exception as exc:  # noqa: BLE001  (a failed phase is reported, the others still run)
            self.errors[name] = f"{type(exc).__name__}: {exc}".strip()
            self.progress(f"{name}: FAILED: {self.errors[name]}")
            traceback.print_exc(file=sys.stderr)
            return None
        finally:
            self.progress(f"{name}: done")


def check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise PhaseTimeout(f"{what}: past the phase's cap")


# -- settings ------------------------------------------------------------------------------------------------------
def engine_flags(args: argparse.Namespace, speculative: str = "none", compare: bool = False) -> list[str]:
    """The engine's command-line flags for this run: the offline engines and `serval serve` share them, so all run
    the same settings (EngineConfig's defaults, then dtype, device, speculation and each --engine-arg; ``compare``:
    then each --compare-engine-arg, which wins)."""
    flags = ["--device", args.device, "--dtype", args.dtype, "--speculative-model", speculative]
    if args.model:
        flags += ["--model", args.model]
    for item in [*args.engine_arg, *(args.compare_engine_arg if compare else [])]:
        key, sep, value = item.partition("=")
        name = "--" + key.strip().removeprefix("--").replace("_", "-")
        if not sep or name == "--":
            raise ValueError(f"--engine-arg takes KEY=VALUE, got {item!r}")
        if value.lower() in ("true", "false"):  # a switch: --flag or --no-flag
            flags.append(name if value.lower() == "true" else "--no-" + name.removeprefix("--"))
        else:
            flags += [name, value]
    return flags


def engine_config(flags: list[str]) -> EngineConfig:
    """EngineConfig from engine flags, parsed as `serval serve` parses them (an unknown key fails here, at once)."""
    parser = argparse.ArgumentParser(prog="bench_gpu --engine-arg", add_help=False, exit_on_error=False)
    add_flags(parser, EngineConfig, exclude=("kv_transfer",))
    parsed, unknown = parser.parse_known_args(flags)
    if unknown:
        raise ValueError(f"not an engine setting: {' '.join(unknown)}")
    return from_args(EngineConfig, parsed)


def stream_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return counts


def prompts_for(count: int) -> list[str]:
    """``count`` distinct short prompts (16 to 24 words), the same in every phase and run."""
    rng = random.Random(0)
    return [f"Story {i}. " + prose(rng, rng.randint(16, 24)) for i in range(count)]


def git_commit() -> str:
    """The SERVAL_COMMIT environment variable where whoever sent this copy of the tree set it (a GPU machine's copy
    can hold stale git metadata: one named the sending session's first commit), else HEAD of this checkout."""
    if os.environ.get("SERVAL_COMMIT"):
        return os.environ["SERVAL_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git history here: set SERVAL_COMMIT)"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def release_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- offline: Serval ------------------------------------------------------------------------------------------------
def serval_generate(run: Run, engine, prompts: list[str], tokens: int, deadline: float, label: str,
                    sampled: bool = False) -> dict:
    """Runs ``prompts`` to ``tokens`` tokens each (greedy, or with ``sampled`` SAMPLED_TEMPERATURE and SAMPLED_TOP_P
    seeded by the request's index; EOS ignored) through the engine's step loop; tokens/s is output tokens over the
    wall time from the first add_request to the last step."""
    ids = [f"{label}-{i}" for i in range(len(prompts))]
    counts = dict.fromkeys(ids, 0)
    start = last_report = time.perf_counter()
    for i, (request_id, prompt) in enumerate(zip(ids, prompts)):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True) if not sampled else \
            SamplingParams(temperature=SAMPLED_TEMPERATURE, top_p=SAMPLED_TOP_P, seed=i, max_tokens=tokens,
                           ignore_eos=True)
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            drain(engine, ids)
            raise PhaseTimeout(f"{label}: {sum(counts.values())} of {len(ids) * tokens} tokens before the cap")
        for output in engine.step():
            counts[output.request_id] = len(output.outputs[0].token_ids)
        if time.perf_counter() - last_report > PROGRESS_EVERY_S:
            last_report = time.perf_counter()
            run.progress(f"  {label}: {sum(counts.values())}/{len(ids) * tokens} tokens")
    synchronize(engine.config.device)
    seconds = time.perf_counter() - start
    generated = sum(counts.values())
    return {"streams": len(prompts), "generated_tokens": generated, "seconds": seconds,
            "tokens_per_s": generated / seconds}


def drain(engine, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def phase_offline(run: Run, deadline: float, engines: list) -> None:
    """Serval at each stream count, speculation off. The engine goes into ``engines`` as soon as it is loaded: the
    profile and n-gram phases reuse it, also when a stream count here failed or ran out of time."""
    from serval.engine.engine import LLMEngine

    args = run.args
    start = time.perf_counter()
    engine = LLMEngine(engine_config(engine_flags(args)))
    engines.append(engine)
    scheduler = engine.config.scheduler
    run.results["engine"] = {"load_s": time.perf_counter() - start, "dtype": engine.config.dtype,
                             "model_path": str(engine.model_path), "max_num_seqs": scheduler.max_num_seqs,
                             "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                             "num_scheduler_steps": scheduler.num_scheduler_steps,
                             "async_output_processing": scheduler.async_output_processing,
                             "kv_blocks": engine.core.info.num_blocks, "block_size": engine.config.cache.block_size,
                             "max_model_len": engine.max_model_len, "quantization": engine.config.quantization,
                             "weight_bytes": weight_bytes(engine.model)}
    run.progress(f"offline: engine loaded in {run.results['engine']['load_s']:.1f} s ({run.results['engine']})")
    serval_generate(run, engine, prompts_for(1), 8, deadline, "warmup")
    table = run.results.setdefault("serval", {})
    for streams in args.streams:
        check_deadline(deadline, f"serval at {streams} streams")
        run.progress(f"offline: serval, {streams} streams x {args.tokens} tokens")
        table[str(streams)] = serval_generate(run, engine, prompts_for(streams), args.tokens, deadline,
                                              f"serval{streams}")
        run.progress(f"offline: serval, {streams} streams: {table[str(streams)]['tokens_per_s']:.1f} tok/s")


def phase_sampled(run: Run, deadline: float, engine) -> None:
    """The offline engine again at each --sampled-streams count, its requests sampled (seeded) instead of greedy."""
    if engine is None:
        raise RuntimeError("no engine: the offline phase failed")
    table = run.results.setdefault("serval_sampled", {})
    serval_generate(run, engine, prompts_for(1), 8, deadline, "sampled-warmup", sampled=True)
    for streams in run.args.sampled_streams:
        check_deadline(deadline, f"sampled at {streams} streams")
        table[str(streams)] = serval_generate(run, engine, prompts_for(streams), run.args.tokens, deadline,
                                              f"sampled{streams}", sampled=True)
        run.progress(f"sampled: {streams} streams: {table[str(streams)]['tokens_per_s']:.1f} tok/s")


# -- the roofline ---------------------------------------------------------------------------------------------------
def copy_bandwidth(device: str, mib: int, repeats: int = 5) -> dict:
    """The memory bandwidth a device-to-device copy of ``mib`` MiB reaches, in bytes a second: it reads and writes
    the buffer once each, so 2 x its bytes over the best of ``repeats`` timed copies (after one untimed)."""
    source = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for i in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    del source, target
    release_memory(device)
    return {"copy_mib": mib, "bytes_per_s": 2 * mib * 2**20 / best}


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of weights one decode step reads: every parameter and buffer once (a tied head and embedding are
    one tensor), but the embedding table where it is not also the head (a step gathers only its tokens' rows) and
    the rotary tables (a step reads its positions' rows)."""
    embedding = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    head_tensors = {id(t) for t in head.parameters()} if head is not None else set()
    skipped = {id(t) for t in embedding.parameters()} - head_tensors if embedding is not None else set()
    tensors = {}
    for module in model.modules():
        if hasattr(module, "cos"):  # a rotary table
            continue
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if id(t) not in skipped:
                tensors[id(t)] = t.numel() * t.element_size()
    return sum(tensors.values())


def roofline_share(tokens_per_s: float, bytes_per_step: int, bytes_per_s: float) -> float:
    """One stream's share of the bandwidth roofline: a step makes one token, so it took 1 / tokens_per_s seconds to
    read ``bytes_per_step``; that rate over the measured bandwidth."""
    return bytes_per_step * tokens_per_s / bytes_per_s


# -- long prompts and context ---------------------------------------------------------------------------------------
def random_prompt(tokens: int, vocab_size: int, seed: int) -> list[int]:
    """``tokens`` token ids drawn at random (seeded): distinct prompts, so that no prefix cache serves one."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (tokens,), generator=generator).tolist()


def long_request(run: Run, engine, prompt: list[int], max_tokens: int, sampled: bool, deadline: float,
                 label: str) -> dict:
    """One request of ``prompt`` (ids) alone in the engine, to ``max_tokens`` tokens (EOS ignored; greedy, or
    sampled as serval_generate samples): its time to first token, and with more than one token its decode tokens/s
    from the first token to the last."""
    params = (SamplingParams(temperature=SAMPLED_TEMPERATURE, top_p=SAMPLED_TOP_P, seed=0, max_tokens=max_tokens,
                             ignore_eos=True) if sampled else
              SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    engine.add_request(label, prompt, params)
    first = None
    generated = 0
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            drain(engine, [label])
            raise PhaseTimeout(f"{label}: {generated} of {max_tokens} tokens before the cap")
        for output in engine.step():
            generated = len(output.outputs[0].token_ids)
            if generated and first is None:
                synchronize(engine.config.device)
                first = time.perf_counter()
    synchronize(engine.config.device)
    if first is None:
        raise RuntimeError(f"{label}: the request ended without a token")
    result = {"prompt_tokens": len(prompt), "generated_tokens": generated, "ttft_ms": 1000 * (first - start)}
    if generated > 1:
        result["decode_tokens_per_s"] = (generated - 1) / (time.perf_counter() - first)
    return result


def phase_long(run: Run, deadline: float, engine) -> None:
    """On the offline engine: each --ttft-prompts prompt's time to first token, and --tokens tokens decoded after a
    --long-context prompt; each greedy and sampled, a fresh random prompt each (no prefix-cache hit). A size the
    engine's context cannot hold is left out, with the reason."""
    if engine is None:
        raise RuntimeError("no engine: the offline phase failed")
    args = run.args
    vocab = engine.core.info.vocab_size
    table = run.results.setdefault("long", {"ttft": {}, "decode": {}, "left_out": []})
    fits = [n for n in args.ttft_prompts if n + 1 <= engine.max_model_len]
    if args.long_context + args.tokens > engine.max_model_len:
        table["left_out"].append(f"decode at {args.long_context} tokens of context: the engine's context is "
                                 f"{engine.max_model_len}")
    table["left_out"] += [f"TTFT of a {n}-token prompt: the engine's context is {engine.max_model_len}"
                          for n in args.ttft_prompts if n not in fits]
    seeds = iter(range(1, 1000))
    if fits:  # the first long prefill pays for whatever compiles or tunes at that size
        long_request(run, engine, random_prompt(min(fits), vocab, 0), 1, False, deadline, "long-warmup")
    for tokens in fits:
        for sampled in (False, True):
            check_deadline(deadline, f"TTFT of {tokens} tokens")
            cell = long_request(run, engine, random_prompt(tokens, vocab, next(seeds)), 1, sampled, deadline,
                                f"ttft{tokens}{'-sampled' if sampled else ''}")
            table["ttft"].setdefault(str(tokens), {})["sampled" if sampled else "greedy"] = cell
            run.progress(f"long: TTFT of {tokens} tokens{' (sampled)' if sampled else ''}: {cell['ttft_ms']:.0f} ms")
    if args.long_context + args.tokens <= engine.max_model_len:
        for sampled in (False, True):
            check_deadline(deadline, f"decode at {args.long_context} tokens")
            cell = long_request(run, engine, random_prompt(args.long_context, vocab, next(seeds)), args.tokens,
                                sampled, deadline, f"context{args.long_context}{'-sampled' if sampled else ''}")
            table["decode"]["sampled" if sampled else "greedy"] = cell
            run.progress(f"long: decode at {args.long_context} tokens{' (sampled)' if sampled else ''}: "
                         f"{cell.get('decode_tokens_per_s', 0):.1f} tok/s")


def phase_ngram(run: Run, deadline: float, weights: tuple | None) -> None:
    """One stream with n-gram speculation on, on the offline engine's weights (model, tokenizer)."""
    from serval.engine.engine import LLMEngine

    if weights is None:
        raise RuntimeError("no weights: the offline phase failed")
    config = engine_config(engine_flags(run.args, speculative="ngram"))
    ngram = LLMEngine(config, model=weights[0], tokenizer=weights[1])
    try:
        serval_generate(run, ngram, prompts_for(1), 8, deadline, "ngram-warmup")
        run.results["serval_ngram"] = {"1": serval_generate(run, ngram, prompts_for(1), run.args.tokens, deadline,
                                                            "ngram1")}
    finally:
        ngram.shutdown()


def phase_compare(run: Run, deadline: float, weights: tuple | None) -> None:
    """The offline stream counts and the decode-step profile again, on the same weights, with the engine settings
    --compare-engine-arg adds: the A/B of a setting in one run."""
    from serval.engine.engine import LLMEngine

    if weights is None:
        raise RuntimeError("no weights: the offline phase failed")
    args = run.args
    engine = LLMEngine(engine_config(engine_flags(args, compare=True)), model=weights[0], tokenizer=weights[1])
    result = run.results["compare"] = {"engine_args": list(args.compare_engine_arg), "offline": {}, "profile": {}}
    try:
        serval_generate(run, engine, prompts_for(1), 8, deadline, "compare-warmup")
        for streams in args.streams:
            check_deadline(deadline, f"compare at {streams} streams")
            result["offline"][str(streams)] = serval_generate(run, engine, prompts_for(streams), args.tokens,
                                                              deadline, f"compare{streams}")
            run.progress(f"compare: {streams} streams: {result['offline'][str(streams)]['tokens_per_s']:.1f} tok/s")
        if "profile" not in args.skip:
            for streams in args.profile_streams:
                result["profile"][str(streams)] = profile_step(run, engine, streams, deadline)
    finally:
        engine.shutdown()


# -- the decode-step profile ----------------------------------------------------------------------------------------
def decode_ready(run: Run, engine, streams: int, deadline: float) -> list[str]:
    """Adds ``streams`` requests and steps until every one has its first token: from then on a step is decodes only."""
    params = SamplingParams(temperature=0, max_tokens=PROFILE_MAX_TOKENS, ignore_eos=True)
    ids = [f"profile{streams}-{i}" for i in range(streams)]
    for request_id, prompt in zip(ids, prompts_for(streams)):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < streams:
        check_deadline(deadline, f"profile: prefill of {streams} streams")
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    return ids


# The profiled requests' length: room for the warm-up step and two windows of steps of up to 8 forwards each.
PROFILE_MAX_TOKENS = 160
PROFILE_WINDOW_STEPS = 3


def profile_step(run: Run, engine, streams: int, deadline: float) -> dict:
    """Decode steps in steady state: a window of PROFILE_WINDOW_STEPS engine steps back to back timed alone, then
    the next such window under the profiler (a step overlaps the host work of the one before, so one step timed
    between two synchronizations would count that overlap as idle). Figures are per engine step; a step runs
    ``forwards_per_step`` forwards (multi-step decoding)."""
    from torch.profiler import ProfilerActivity, profile

    device = engine.config.device
    on_gpu = device.startswith("cuda")
    ids = decode_ready(run, engine, streams, deadline)
    stats = engine.stats
    try:
        engine.step()  # warms the bucket up
        synchronize(device)
        start, tokens = time.perf_counter(), stats.num_scheduled_tokens
        for _ in range(PROFILE_WINDOW_STEPS):
            engine.step()
        synchronize(device)
        step_s = (time.perf_counter() - start) / PROFILE_WINDOW_STEPS
        forwards = (stats.num_scheduled_tokens - tokens) / PROFILE_WINDOW_STEPS / streams
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(PROFILE_WINDOW_STEPS):
                engine.step()
            synchronize(device)
            profiled_s = (time.perf_counter() - start) / PROFILE_WINDOW_STEPS
        running = sum(1 for i in ids if engine.outputs.groups.get(i) is not None)
    finally:
        drain(engine, ids)
    summary = {"streams": streams, "running_in_step": running, "profiled_step_ms": 1000 * profiled_s,
               "forwards_per_step": forwards}
    return {**summary, **summarize_step(prof.events(), step_s, on_gpu, PROFILE_WINDOW_STEPS)}


def summarize_step(events, step_s: float, on_gpu: bool, num_steps: int = 1) -> dict:
    """The profiler events of ``num_steps`` steps as figures per step: the operators dispatched (aten's and any
    registered with torch, nested ones included; Serval's pybind11 CPU kernels are not among them) and the top host
    events by self CPU time; on a GPU also the kernels and copies it ran, the host's launch calls, and the GPU-busy
    share: the device time summed over kernels and copies, over the wall time ``step_s`` of an unprofiled step."""
    host = [e for e in events if e.device_type == DeviceType.CPU]
    summary = {"step_ms": 1000 * step_s, "ops": sum("::" in e.name for e in host) / num_steps,
               "top_ops": top_by_time(host, lambda e: e.self_cpu_time_total)}
    if on_gpu:
        device_events = [e for e in events if e.device_type == DeviceType.CUDA]
        kernels = [e for e in device_events if not e.name.startswith(("Memcpy", "Memset"))]
        busy_us = sum(e.time_range.elapsed_us() for e in device_events) / num_steps
        launches = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(LAUNCH_CALLS)]
        summary.update(kernels=len(kernels) / num_steps, copies=(len(device_events) - len(kernels)) / num_steps,
                       launch_calls=len(launches) / num_steps, device_busy_ms=busy_us / 1000,
                       gpu_busy=busy_us / 1e6 / step_s,
                       top_kernels=top_by_time(device_events, lambda e: e.time_range.elapsed_us()))
    return summary


def top_by_time(events, duration, count: int = 5) -> list[dict]:
    """The ``count`` names with the most total time (µs), each with its calls."""
    totals: dict[str, list] = {}
    for e in events:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += duration(e)
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]
    return [{"name": name, "total_us": total, "calls": calls} for name, (total, calls) in ranked]


def phase_profile(run: Run, deadline: float, engine) -> None:
    if engine is None:
        raise RuntimeError("no engine: the offline phase failed")
    table = run.results.setdefault("profile", {})
    for streams in run.args.profile_streams:
        run.progress(f"profile: one decode step at {streams} streams")
        table[str(streams)] = profile_step(run, engine, streams, deadline)


# -- transformers ---------------------------------------------------------------------------------------------------
def phase_transformers(run: Run, deadline: float, model_path: Path) -> None:
    """transformers' batched greedy generate on the same weights, dtype and device; a batch is the streams."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = run.args
    where = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    directory = str(model_path.parent if where else model_path)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(directory, padding_side="left", **where)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.dtype), **where)
    model = model.to(args.device).eval()
    run.progress(f"transformers: loaded in {time.perf_counter() - start:.1f} s")
    table = run.results.setdefault("transformers", {})

    def generate(prompts: list[str], tokens: int) -> dict:
        batch = tokenizer(prompts, return_tensors="pt", padding=True).to(args.device)
        synchronize(args.device)
        begin = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, max_time=max(1.0, deadline - time.monotonic()))
        synchronize(args.device)
        seconds = time.perf_counter() - begin
        new = out.shape[1] - batch.input_ids.shape[1]
        if new < tokens:
            raise PhaseTimeout(f"transformers at {len(prompts)} streams: {new} of {tokens} tokens before the cap")
        return {"streams": len(prompts), "generated_tokens": new * out.shape[0], "seconds": seconds,
                "tokens_per_s": new * out.shape[0] / seconds}

    with torch.inference_mode():
        generate(prompts_for(1), 4)  # warm-up
        for streams in args.streams:
            check_deadline(deadline, f"transformers at {streams} streams")
            run.progress(f"transformers: {streams} streams x {args.tokens} tokens")
            table[str(streams)] = generate(prompts_for(streams), args.tokens)
            run.progress(f"transformers: {streams} streams: {table[str(streams)]['tokens_per_s']:.1f} tok/s")


# -- the server -----------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the server and its engine core), SIGKILL to whatever is left."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the leader is gone; its children, if any, go now
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def wait_healthy(proc: subprocess.Popen, url: str, deadline: float, log: Path) -> None:
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"serval serve exited with code {proc.returncode}: " + " | ".join(tail))
        check_deadline(deadline, "serval serve did not answer /health")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)


def phase_server(run: Run, deadline: float) -> None:
    """`serval serve` as a subprocess (same engine flags, speculation off), measured by `serval bench serve`'s
    client at each server stream count, then stopped."""
    from serval.benchmark.client import Endpoint, LoadConfig
    from serval.benchmark.serve import ServeBenchConfig, run_serve_benchmark
    from serval.benchmark.workloads import WorkloadConfig

    args = run.args
    port = free_port()
    log = Path(args.out) / "server.log"
    cmd = [sys.executable, "-m", "serval.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVER_MODEL_NAME, *engine_flags(args)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # A process group of its own, stopped as one (the server and its engine core); in this session where Python
    # allows (3.11), so that whatever ends this script's session ends the server too.
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO, **group)
    run.results["server_pid"] = proc.pid
    try:
        start = time.perf_counter()
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", deadline, log)
        run.progress(f"server: healthy after {time.perf_counter() - start:.1f} s on port {port}")
        table = run.results.setdefault("server", {})
        for streams in args.server_streams:
            check_deadline(deadline, f"server at {streams} streams")
            requests = max(4, 2 * streams)
            run.progress(f"server: {requests} requests, {streams} concurrent, {args.tokens} tokens each")
            endpoint = Endpoint(base_url=f"http://127.0.0.1:{port}/v1", model=SERVER_MODEL_NAME, ignore_eos=True,
                                timeout_s=max(1.0, deadline - time.monotonic()))
            config = ServeBenchConfig(endpoint=endpoint, load=LoadConfig(concurrency=streams),
                                      workload=WorkloadConfig(num_requests=requests, input_words=(16, 24),
                                                              output_tokens=(args.tokens, args.tokens)))
            summary = run_serve_benchmark(config, progress=False)["summary"]
            if summary["failed"] and time.monotonic() > deadline:  # a request's timeout is what was left of the cap
                raise PhaseTimeout(f"server at {streams} streams: {summary['failed']} requests ran past the cap")
            if summary["failed"]:
                raise RuntimeError(f"server at {streams} streams: {summary['failed']} requests failed: "
                                   f"{summary['errors']}")
            table[str(streams)] = {k: summary[k] for k in ("num_requests", "output_tokens", "duration_s",
                                                           "output_throughput", "ttft_ms", "tpot_ms", "itl_ms")}
            run.progress(f"server: {streams} streams: {summary['output_throughput']:.1f} tok/s")
    finally:
        stop_server(proc)


# -- the report -----------------------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def roofline_lines(run: Run) -> list[str]:
    """One stream's tokens/s (greedy, sampled) as a share of the roofline: the weights' bytes a step over the
    measured copy bandwidth."""
    r = run.results
    engine, bandwidth = r.get("engine"), r.get("bandwidth")
    if not engine or not bandwidth:
        return []
    bytes_per_s, weights = bandwidth["bytes_per_s"], engine["weight_bytes"]
    lines = ["", f"Roofline: {weights / 1e9:,.2f} GB of weights read a decode step "
                 f"(--quantization {engine.get('quantization', '?')}); {bytes_per_s / 1e9:,.0f} GB/s measured (a "
                 f"{bandwidth['copy_mib']} MiB device-to-device copy: read + written over its best time), so at most "
                 f"{bytes_per_s / weights:,.1f} tok/s at one stream.", ""]
    for label, row in (("greedy", r.get("serval", {})), ("sampled", r.get("serval_sampled", {}))):
        if "1" in row:
            tokens_per_s = row["1"]["tokens_per_s"]
            lines.append(f"- one stream, {label}: {tokens_per_s:,.1f} tok/s, "
                         f"{100 * roofline_share(tokens_per_s, weights, bytes_per_s):.1f}% of the roofline")
    return lines


def long_lines(run: Run) -> list[str]:
    """The long phase's table: TTFT of each long prompt and decode tokens/s at the long context, greedy and
    sampled."""
    long = run.results.get("long")
    if not long:
        return []
    lines = ["", "## Long prompts and context (one request alone, random prompt ids)", "",
             "| request | greedy | sampled |", "|---|---|---|"]
    for tokens, cells in long["ttft"].items():
        lines.append(f"| TTFT, {int(tokens):,}-token prompt (ms) | "
                     + " | ".join(_num(cells[k]["ttft_ms"]) if k in cells else "-" for k in ("greedy", "sampled"))
                     + " |")
    if long["decode"]:
        cells = long["decode"]
        context = next(iter(cells.values()))["prompt_tokens"]
        lines.append(f"| decode after a {context:,}-token prompt (tok/s) | "
                     + " | ".join(_num(cells[k].get("decode_tokens_per_s")) if k in cells else "-"
                                  for k in ("greedy", "sampled")) + " |")
    if long["left_out"]:
        lines += ["", *(f"- left out: {reason}" for reason in long["left_out"])]
    return lines


def format_report(run: Run) -> str:
    args, r = run.args, run.results
    m = r["machine"]
    lines = ["# Serval GPU benchmark", "", "## Machine", "",
             f"- GPU: {m['gpu']}", f"- CPU: {m['cpu']}", f"- torch: {m['torch']}", f"- Serval commit: {m['commit']}",
             f"- model: {m['model']}; device {args.device}, dtype {args.dtype}, {args.tokens} new tokens a request, "
             f"greedy (the sampled row: temperature {SAMPLED_TEMPERATURE}, top-p {SAMPLED_TOP_P}, seeded), EOS "
             "ignored", ""]
    engine = r.get("engine")
    if engine:
        lines += [f"Serval engine: max_num_seqs {engine['max_num_seqs']}, token budget "
                  f"{engine['max_num_batched_tokens']}, up to {engine.get('num_scheduler_steps', 1)} forwards a "
                  f"decode step, async output processing {engine.get('async_output_processing')}, "
                  f"{engine['kv_blocks']} KV blocks of {engine['block_size']} "
                  f"tokens, loaded in {engine['load_s']:.1f} s; engine args: {' '.join(args.engine_arg) or 'none'}", ""]
    streams = sorted(set(args.streams) | {int(count) for count in r.get("serval_sampled", {})})
    lines += ["## Offline throughput (output tokens/s)", "", "| engine | " + " | ".join(map(str, streams)) + " |",
              "|---|" + "---|" * len(streams)]
    compare = r.get("compare", {})
    compare_label = "Serval, speculation off, " + " ".join(compare.get("engine_args", []))
    for row, label in ((r.get("serval", {}), "Serval, speculation off"),
                       (r.get("serval_sampled"), "Serval, speculation off, sampled"),
                       (compare.get("offline"), compare_label),
                       (r.get("serval_ngram", {}), "Serval, n-gram speculation on"),
                       (r.get("transformers", {}), "transformers generate")):
        if row is None:  # no compare or sampled phase
            continue
        lines.append(f"| {label} | " + " | ".join(_num(row[str(s)]["tokens_per_s"]) if str(s) in row else "-"
                                                  for s in streams) + " |")
    lines += roofline_lines(run)
    lines += long_lines(run)
    lines += ["", "## Server (`serval serve`, speculation off)", "",
              "| streams | requests | output tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms |",
              "|---|---|---|---|---|---|"]
    for streams_key, s in r.get("server", {}).items():
        dists = [" / ".join(_num(s[k][f"p{q}"]) for q in (50, 90, 99)) for k in ("ttft_ms", "tpot_ms", "itl_ms")]
        lines.append(f"| {streams_key} | {s['num_requests']} | {_num(s['output_throughput'])} | " + " | ".join(dists)
                     + " |")
    lines += ["", "## Decode steps (torch.profiler, per engine step in steady state)", ""]
    profiles = [("", p) for p in r.get("profile", {}).items()]
    profiles += [(" (" + " ".join(compare["engine_args"]) + ")", p) for p in compare.get("profile", {}).items()]
    for settings, (streams_key, p) in profiles:
        if "gpu_busy" in p:
            busy = (f"GPU busy {100 * p['gpu_busy']:.1f}% ({_num(p['device_busy_ms'], 2)} ms of device time), "
                    f"{p['kernels']:.0f} kernels + {p['copies']:.0f} copies a step from {p['launch_calls']:.0f} "
                    "launch calls")
        else:
            busy = "GPU busy n/a (CPU run)"
        lines.append(f"- profile{settings}, {streams_key} streams: step {_num(p['step_ms'], 2)} ms "
                     f"({_num(p['profiled_step_ms'], 2)} ms under the profiler) of "
                     f"{_num(p.get('forwards_per_step', 1.0))} forwards, {busy}, {p['ops']:.0f} operators dispatched")
        for title, key in (("top kernels", "top_kernels"), ("top host events (self CPU)", "top_ops")):
            if key in p:
                lines.append(f"  - {title}: " + "; ".join(f"`{t['name'][:80]}` {_num(t['total_us'] / 1000, 3)} ms "
                                                           f"x{t['calls']}" for t in p[key]))
    lines += ["", "## Errors", ""]
    lines += [f"- {phase}: {error}" for phase, error in run.errors.items()] or ["none"]
    lines.append(f"\nTotal {time.monotonic() - run.started:.1f} s.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="embedded model name, .gguf file or HF directory "
                        "(default: the embedded model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--streams", type=stream_counts, default=[1, 16, 64, 256],
                        help="offline stream counts (Serval and transformers)")
    parser.add_argument("--sampled-streams", type=stream_counts, default=[1, 64],
                        help="offline stream counts of the sampled phase (Serval's requests seeded and sampled)")
    parser.add_argument("--server-streams", type=stream_counts, default=[1, 16], help="concurrent server streams")
    parser.add_argument("--profile-streams", type=stream_counts, default=[1, 64],
                        help="streams of the profiled decode step")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    parser.add_argument("--ttft-prompts", type=stream_counts, default=[4096, 16384],
                        help="prompt lengths (tokens) of the long phase's time-to-first-token requests")
    parser.add_argument("--long-context", type=int, default=32768,
                        help="prompt length (tokens) after which the long phase decodes --tokens tokens")
    parser.add_argument("--bandwidth-mib", type=int, default=None,
                        help="MiB of the device-to-device copy that measures the memory bandwidth (the roofline's; "
                        "default 2048 on a GPU, far past its caches, and 256 on the CPU)")
    parser.add_argument("--skip", type=lambda t: [x for x in t.split(",") if x], default=[],
                        help=f"phases to leave out, of {','.join(SKIPPABLE)}")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting over EngineConfig's defaults, as serve's flag without the dashes "
                        "(max_num_seqs=256, enable_prefix_caching=false); repeatable; the server gets it too")
    parser.add_argument("--compare-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="run the offline stream counts and the profile again with these settings on top "
                        "(the compare phase, on the same weights); repeatable")
    parser.add_argument("--cap-scale", type=float, default=1.0,
                        help="multiplies every phase's time cap (sized for a GPU; a busy CPU may need more)")
    parser.add_argument("--out", required=True, help="folder for report.md, report.json and server.log")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.skip) - set(SKIPPABLE))
    if unknown:
        parser.error(f"--skip: unknown phase(s) {unknown}; choose from {list(SKIPPABLE)}")
    if args.bandwidth_mib is None:
        args.bandwidth_mib = 2048 if args.device.startswith("cuda") else 256
    if args.tokens < 1 or not args.cap_scale > 0 or args.long_context < 1 or args.bandwidth_mib < 1:
        parser.error("--tokens, --cap-scale, --long-context and --bandwidth-mib must be positive")
    try:
        engine_config(engine_flags(args, compare=True))  # bad engine settings fail now, before any phase
    except (ValueError, argparse.ArgumentError) as exc:
        parser.error(f"engine settings: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (a timeout around this script) unwinds like an error, so the server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run = Run(args)
    from serval.model.registry import resolve_model_path

    run.results["machine"] = {
        "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "cpu": describe_hardware(), "torch": torch.__version__, "commit": git_commit(),
        "model": str(resolve_model_path(args.model))}
    run.results["bandwidth"] = copy_bandwidth(args.device, args.bandwidth_mib)
    run.progress(f"machine: {run.results['machine']}; copy bandwidth "
                 f"{run.results['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")
    engines: list = []
    run.phase("offline", phase_offline, engines)
    engine = engines.pop() if engines else None
    if "sampled" not in args.skip:
        run.phase("sampled", phase_sampled, engine)
    if "long" not in args.skip:
        run.phase("long", phase_long, engine)
    if "profile" not in args.skip:
        run.phase("profile", phase_profile, engine)
    weights = None if engine is None else (engine.model, engine.tokenizer)
    if engine is not None:
        engine.shutdown()
    del engine  # its KV cache goes before the n-gram engine sizes its own from the free memory
    release_memory(args.device)
    if args.compare_engine_arg:
        run.phase("compare", phase_compare, weights)
        release_memory(args.device)
    if "ngram" not in args.skip:
        run.phase("ngram", phase_ngram, weights)
    del weights  # the weights go before transformers and the server need the device's memory
    release_memory(args.device)
    if "transformers" not in args.skip:
        run.phase("transformers", phase_transformers, Path(run.results["machine"]["model"]))
        release_memory(args.device)
    if "server" not in args.skip:
        run.phase("server", phase_server)
    report = format_report(run)
    print(report, flush=True)
    (Path(args.out) / "report.md").write_text(report)
    figures = {"settings": {k: v for k, v in vars(args).items()}, **run.results, "errors": run.errors,
               "phase_cap_s": PHASE_CAP_S}
    (Path(args.out) / "report.json").write_text(json.dumps(figures, indent=2))
    run.progress(f"wrote {args.out}/report.md and report.json")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
