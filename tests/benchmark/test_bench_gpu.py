"""benchmarks/bench_gpu.py end to end on the CPU at small sizes (a tiny model, 2 streams, 4 tokens), so that the
script the GPU figures come from cannot rot: every phase runs (transformers and the server included), the report
holds every section with numbers, and no server process outlives the script; and the 8B run's phases (roofline,
long prompts, decode at a long context) on a tiny config with dummy FP8 weights."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from real_model import MODEL_PATH, requires_model
from tiny_models import TINY, save_family_dir
from torch.autograd import DeviceType
from transformers import LlamaConfig

from serval.model.loader import load_model
from serval.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


def processes_in_group(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (the server ran in a group of its own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_family_dir(directory, "llama", Tokenizer.load(MODEL_PATH).hf_tokenizer)
    return directory


@requires_model  # the tiny model's tokenizer is the embedded SmolLM2's
def test_bench_gpu_runs_every_phase_and_reports_every_figure(tiny_dir, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32",
         "--streams", "1,2", "--sampled-streams", "2", "--server-streams", "1,2", "--profile-streams", "1,2",
         "--tokens", "4",
         "--engine-arg", "max_num_seqs=8", "--compare-engine-arg", "num_scheduler_steps=2",
         "--compare-engine-arg", "async_scheduling=true", "--cap-scale", "4", "--out", str(out)],  # caps: a GPU's
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = proc.stdout
    assert (out / "report.md").read_text() in report
    figures = json.loads((out / "report.json").read_text())
    assert figures["errors"] == {}
    assert "[bench_gpu" in proc.stderr and "server: healthy" in proc.stderr  # progress goes to stderr

    # The machine: no GPU here, the CPU kind from platform_info, torch and the commit.
    for section in ("## Machine", "## Offline throughput", "## Server", "## Decode steps", "## Errors"):
        assert section in report
    assert "- GPU: cpu" in report
    assert re.search(r"- CPU: .*capability \w+, native bf16: (yes|no)", report)
    assert re.search(r"- Serval commit: [0-9a-f]{7}", report)
    assert figures["engine"]["max_num_seqs"] == 8  # the --engine-arg reached the engine

    # Offline: tokens/s for every stream count, Serval and transformers; n-gram speculation at one stream.
    for key in ("serval", "transformers"):
        for streams in (1, 2):
            cell = figures[key][str(streams)]
            assert cell["generated_tokens"] == 4 * streams and cell["tokens_per_s"] > 0
    assert figures["serval_ngram"]["1"]["generated_tokens"] == 4 and figures["serval_ngram"]["1"]["tokens_per_s"] > 0
    assert re.search(r"\| Serval, speculation off \| [\d,.]+ \| [\d,.]+ \|", report)
    assert re.search(r"\| Serval, n-gram speculation on \| [\d,.]+ \| - \|", report)
    # The sampled phase: the offline engine's requests seeded and sampled, at its own stream counts.
    assert figures["serval_sampled"]["2"]["generated_tokens"] == 8 and "1" not in figures["serval_sampled"]
    assert re.search(r"\| Serval, speculation off, sampled \| - \| [\d,.]+ \|", report)
    assert re.search(r"\| transformers generate \| [\d,.]+ \| [\d,.]+ \|", report)
    # The compare phase: the same counts and profile with its settings on top, in the same run.
    compare = figures["compare"]
    assert compare["engine_args"] == ["num_scheduler_steps=2", "async_scheduling=true"]
    assert [compare["offline"][str(s)]["generated_tokens"] for s in (1, 2)] == [4, 8]
    settings = "num_scheduler_steps=2 async_scheduling=true"
    assert re.search(rf"\| Serval, speculation off, {settings} \| [\d,.]+ \| [\d,.]+ \|", report)
    assert compare["profile"]["2"]["forwards_per_step"] == 2 and figures["profile"]["2"]["forwards_per_step"] == 1

    # The server: output tok/s and TTFT / TPOT / ITL percentiles at each stream count.
    for streams in (1, 2):
        server = figures["server"][str(streams)]
        assert server["output_throughput"] > 0 and server["output_tokens"] == 4 * server["num_requests"]
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert all(server[metric][f"p{q}"] > 0 for q in (50, 90, 99))
        assert re.search(rf"\| {streams} \| \d+ \| [\d,.]+ \|( [\d,.]+ / [\d,.]+ / [\d,.]+ \|){{3}}", report)

    # The profile of one decode step: on the CPU, ops and top ops; GPU busy is n/a.
    for streams in (1, 2):
        profile = figures["profile"][str(streams)]
        assert profile["running_in_step"] == streams and profile["step_ms"] > 0 and profile["ops"] > 0
        assert len(profile["top_ops"]) == 5
        assert re.search(rf"- profile, {streams} streams: step [\d,.]+ ms .*GPU busy n/a \(CPU run\), "
                         r"\d+ operators dispatched", report)
        assert re.search(rf"- profile \({settings}\), {streams} streams: step ", report)
    assert "top host events (self CPU): `" in report

    # No server process is left: neither the server nor anything in its process group.
    pid = figures["server_pid"]
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    assert processes_in_group(pid) == []


def test_a_failed_phase_is_reported_and_the_others_run(tmp_path):
    bench = load_script()
    run = bench.Run(bench.parse_args(["--device", "cpu", "--out", str(tmp_path)]))

    def broken(run, deadline):
        raise RuntimeError("no device")

    def fine(run, deadline):
        return "measured"

    assert run.phase("server", broken) is None
    assert run.phase("profile", fine) == "measured"
    assert run.errors == {"server": "RuntimeError: no device"}


def test_engine_args_become_serve_flags_and_bad_ones_fail_at_once(tmp_path):
    bench = load_script()
    args = bench.parse_args(["--device", "cpu", "--out", str(tmp_path), "--engine-arg", "max_num_seqs=256",
                             "--engine-arg", "enable_prefix_caching=false"])
    flags = bench.engine_flags(args)
    assert flags[-3:] == ["--max-num-seqs", "256", "--no-enable-prefix-caching"]
    assert "--speculative-model" in flags and flags[flags.index("--speculative-model") + 1] == "none"
    config = bench.engine_config(flags)
    assert config.scheduler.max_num_seqs == 256 and not config.cache.enable_prefix_caching
    assert config.speculative.method is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--out", str(tmp_path), "--engine-arg", "no_such_setting=1"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--out", str(tmp_path), "--skip", "offline"])


def _event(name: str, device: str, us: float = 0.0, self_cpu_us: float = 0.0) -> SimpleNamespace:
    """A profiler event as summarize_step reads it."""
    return SimpleNamespace(name=name, device_type=getattr(DeviceType, device), self_cpu_time_total=self_cpu_us,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_a_gpu_step_summary_counts_kernels_launches_and_the_busy_share():
    bench = load_script()
    events = [_event("aten::mm", "CPU", self_cpu_us=30), _event("aten::mm", "CPU", self_cpu_us=30),
              _event("aten::add", "CPU", self_cpu_us=50), _event("cudaLaunchKernel", "CPU"),
              _event("cudaLaunchKernel", "CPU"), _event("cudaGraphLaunch", "CPU"), _event("cudaMemcpyAsync", "CPU"),
              _event("gemm_kernel", "CUDA", us=300), _event("gemm_kernel", "CUDA", us=300),
              _event("attention_kernel", "CUDA", us=200), _event("Memcpy HtoD (Pageable -> Device)", "CUDA", us=100)]
    summary = bench.summarize_step(events, step_s=0.002, on_gpu=True)  # 900 us of device time in a 2 ms step
    assert summary["gpu_busy"] == pytest.approx(0.45) and summary["device_busy_ms"] == pytest.approx(0.9)
    assert (summary["kernels"], summary["copies"], summary["launch_calls"]) == (3, 1, 3)
    assert [(k["name"], k["total_us"], k["calls"]) for k in summary["top_kernels"]] == [
        ("gemm_kernel", 600, 2), ("attention_kernel", 200, 1), ("Memcpy HtoD (Pageable -> Device)", 100, 1)]
    assert summary["ops"] == 3  # the operators; the runtime calls are host events, not operators
    assert [o["name"] for o in summary["top_ops"]][:2] == ["aten::mm", "aten::add"]
    assert summary["step_ms"] == pytest.approx(2.0)

    on_cpu = bench.summarize_step(events, step_s=0.002, on_gpu=False)
    assert "gpu_busy" not in on_cpu and "top_kernels" not in on_cpu and on_cpu["ops"] == 3


def test_the_readme_names_the_phase_caps_the_script_has():
    bench = load_script()
    readme = (REPO / "benchmarks" / "README.md").read_text()
    names = {"offline": "offline", "sampled": "sampled", "long": "long", "ngram": "n-gram", "profile": "profile",
             "compare": "compare", "transformers": "transformers", "server": "server"}
    assert set(names) == set(bench.PHASE_CAP_S)
    for phase, cap in bench.PHASE_CAP_S.items():
        assert re.search(rf"\b{names[phase]}\s+{cap:g} s\b", readme), phase


def test_the_commit_comes_from_serval_commit_where_set_else_from_git(tmp_path, monkeypatch):
    bench = load_script()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.delenv("SERVAL_COMMIT", raising=False)
    assert bench.git_commit().startswith(head)
    monkeypatch.setenv("SERVAL_COMMIT", "abc1234")  # the sender's word wins over a copy's (maybe stale) git metadata
    assert bench.git_commit() == "abc1234"
    monkeypatch.delenv("SERVAL_COMMIT")
    monkeypatch.setattr(bench, "REPO", tmp_path)  # a copy of the tree without .git and no word from its sender
    assert bench.git_commit().startswith("unknown")


def _config_dir(directory: Path, **overrides) -> Path:
    """A directory with only a tiny Llama's config.json and SmolLM2's tokenizer: what --load-format dummy needs."""
    Tokenizer.load(MODEL_PATH).hf_tokenizer.save_pretrained(directory)
    LlamaConfig(**{**TINY, "vocab_size": 49152, **overrides}).save_pretrained(directory)
    return directory


def _decode_step_bytes(hidden: int, intermediate: int, layers: int, q: int, kv: int, vocab: int, dtype_bytes: int,
                       linear_bytes: float, scale_bytes: int, tied: bool) -> int:
    """A Llama's weight bytes a decode step reads, counted by hand: per layer q/k/v, o, gate/up and down (each row
    with its scale where quantized) and two norms; the final norm and the head (the embedding only where tied)."""
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * intermediate, hidden), (hidden, intermediate)]
    per_layer = sum(rows * cols * linear_bytes + rows * scale_bytes for rows, cols in shapes) + 2 * hidden * dtype_bytes
    return int(layers * per_layer + hidden * dtype_bytes + vocab * hidden * dtype_bytes)


@requires_model  # the tokenizer is the embedded SmolLM2's
@pytest.mark.parametrize(("quantization", "tied"), [("none", False), ("fp8", False), ("none", True)])
def test_weight_bytes_are_what_a_decode_step_reads(tmp_path, quantization, tied):
    bench = load_script()
    directory = _config_dir(tmp_path, tie_word_embeddings=tied)
    model = load_model(directory, torch.float32, quantization=quantization, load_format="dummy")
    fp8 = quantization == "fp8"
    assert bench.weight_bytes(model) == _decode_step_bytes(64, 128, 2, 64, 32, 49152, 4, 1 if fp8 else 4,
                                                           4 if fp8 else 0, tied)


def test_one_streams_share_of_the_roofline():
    bench = load_script()
    # 16 GB of weights a step at 100 tok/s reads 1.6 TB/s: 40% of a 4 TB/s device.
    assert bench.roofline_share(100.0, 16 * 10**9, 4e12) == pytest.approx(0.4)


def test_the_copy_bandwidth_is_measured_on_the_device():
    bench = load_script()
    measured = bench.copy_bandwidth("cpu", 4, repeats=2)
    assert measured["copy_mib"] == 4 and measured["bytes_per_s"] > 0


@requires_model
def test_a_config_with_dummy_fp8_weights_runs_the_sized_phases(tmp_path):
    """The 8B run's phases on a tiny config with random weights (--load-format dummy) in FP8: one stream against the
    roofline, greedy and sampled; each long prompt's TTFT and the decode at a long context, greedy and sampled; a
    size past the context left out by name, not failed."""
    directory = _config_dir(tmp_path / "model")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(directory), "--device", "cpu", "--dtype", "float32",
         "--engine-arg", "load_format=dummy", "--engine-arg", "quantization=fp8", "--streams", "1,2",
         "--sampled-streams", "1,2", "--tokens", "4", "--ttft-prompts", "32,64,1000", "--long-context", "96",
         "--bandwidth-mib", "8", "--skip", "transformers,server,profile,ngram", "--cap-scale", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report, figures = proc.stdout, json.loads((out / "report.json").read_text())
    assert figures["errors"] == {} and "transformers" not in figures and "serval_ngram" not in figures
    assert figures["engine"]["quantization"] == "fp8" and figures["bandwidth"]["copy_mib"] == 8
    assert figures["engine"]["weight_bytes"] == _decode_step_bytes(64, 128, 2, 64, 32, 49152, 4, 1, 4, False)
    assert re.search(r"Roofline: [\d.]+ GB of weights read a decode step \(--quantization fp8\); [\d,]+ GB/s "
                     r"measured", report)
    for label in ("greedy", "sampled"):
        assert re.search(rf"- one stream, {label}: [\d,.]+ tok/s, [\d.]+% of the roofline", report)

    long = figures["long"]
    for tokens in ("32", "64"):
        for label in ("greedy", "sampled"):
            cell = long["ttft"][tokens][label]
            assert cell["prompt_tokens"] == int(tokens) and cell["generated_tokens"] == 1 and cell["ttft_ms"] > 0
        assert re.search(rf"\| TTFT, {tokens}-token prompt \(ms\) \| [\d,.]+ \| [\d,.]+ \|", report)
    for label in ("greedy", "sampled"):
        cell = long["decode"][label]
        assert cell["prompt_tokens"] == 96 and cell["generated_tokens"] == 4 and cell["decode_tokens_per_s"] > 0
    assert re.search(r"\| decode after a 96-token prompt \(tok/s\) \| [\d,.]+ \| [\d,.]+ \|", report)
    assert long["left_out"] == ["TTFT of a 1000-token prompt: the engine's context is 256"]
    assert "- left out: TTFT of a 1000-token prompt" in report


def test_gpu_checks_8b_runs_parse_and_fit_the_device_budget(tmp_path):
    """scripts/gpu_check.sh --sized-only, with a stand-in for Python that records its arguments: three runs of
    bench_gpu.py on the 8B configs with random weights (Llama in bfloat16 and FP8, Qwen3 in bfloat16), each of
    whose flags bench_gpu.py accepts, and whose phases' caps add up to at most 6.5 minutes (the script's claim: one
    call of a 15-minute device session)."""
    bench = load_script()
    record = tmp_path / "calls.txt"
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {record}\necho END >> {record}\n')
    stand_in.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), "--sized-only"],
                          env={**os.environ, "PYTHON": str(stand_in)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [call.strip("\n").split("\n") for call in record.read_text().split("END\n") if call.strip()]
    assert [call[0] for call in calls] == ["benchmarks/bench_gpu.py"] * 3
    total_cap_s = 0.0
    for call in calls:
        args = bench.parse_args(call[1:])
        assert "load_format=dummy" in args.engine_arg and args.tokens == 64
        assert args.streams == [1, 64, 256] and args.sampled_streams == [1, 64, 256]
        run_phases = [p for p in bench.PHASES if p not in args.skip and (p != "compare" or args.compare_engine_arg)]
        total_cap_s += sum(bench.PHASE_CAP_S[p] * args.cap_scale for p in run_phases)
    models = [bench.parse_args(call[1:]).model for call in calls]
    assert models == ["benchmarks/configs/Llama-3.1-8B"] * 2 + ["benchmarks/configs/Qwen3-8B"]
    assert "quantization=fp8" in bench.parse_args(calls[1][1:]).engine_arg
    first = bench.parse_args(calls[0][1:])
    assert (first.ttft_prompts, first.long_context, "long" in first.skip) == ([4096, 16384], 32768, False)
    assert total_cap_s <= 6.5 * 60


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Qwen3-8B"])
def test_an_8b_configs_bytes_a_step_are_its_checkpoints_but_the_embedding(name):
    """The roofline's numerator at the real size (built on the meta device: shapes, no memory): every tensor of the
    published checkpoint (benchmarks/make_sized_models.py's list) but the untied embedding, 2 bytes each in
    bfloat16; in FP8 the decoder's matrices 1 byte a weight and 4 a row's scale, the rest as before."""
    from serval.layers.fp8_linear import quantize_linears_to_fp8
    from serval.model.hf_config import read_hf_config
    from serval.model.llama import LlamaForCausalLM

    bench = load_script()
    spec = importlib.util.spec_from_file_location("make_sized_models", REPO / "benchmarks" / "make_sized_models.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    directory = REPO / "benchmarks" / "configs" / name
    shapes = dict(make.tensor_shapes(json.loads((directory / "config.json").read_text())))
    read = {key: torch.Size(shape).numel() for key, shape in shapes.items() if key != "model.embed_tokens.weight"}
    with torch.device("meta"):
        model = LlamaForCausalLM(read_hf_config(directory)).to(torch.bfloat16)
    assert bench.weight_bytes(model) == 2 * sum(read.values())
    quantize_linears_to_fp8(model)
    matrices = {key: numel for key, numel in read.items() if key.endswith("proj.weight")}
    rows = sum(shapes[key][0] for key in matrices)
    assert bench.weight_bytes(model) == 2 * (sum(read.values()) - sum(matrices.values())) + sum(matrices.values()) \
        + 4 * rows
