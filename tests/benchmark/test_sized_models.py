"""benchmarks/configs/ and benchmarks/make_sized_models.py: the configs have their published sizes and stay small,
the random checkpoints load in transformers with every tensor named as the real checkpoints name them, and
run_peers.py counts a GGUF's bytes per decoded token and holds each one-stream row to its own bandwidth measure."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from real_model import MODEL_PATH, requires_model

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "benchmarks" / "configs"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


# Parameter counts as their model cards give them.
PUBLISHED = {"Llama-3.2-1B": 1.24e9, "Llama-3.1-8B": 8.03e9, "Qwen3-8B": 8.19e9, "Mixtral-8x7B": 46.7e9,
             "Qwen3-30B-A3B": 30.5e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_has_its_published_size_and_a_small_offline_tokenizer(name):
    make = load_script("make_sized_models")
    config = json.loads((CONFIGS / name / "config.json").read_text())
    params = sum(torch.Size(shape).numel() for _, shape in make.tensor_shapes(config))
    assert abs(params - PUBLISHED[name]) / PUBLISHED[name] < 0.005
    assert config["torch_dtype"] == "bfloat16"
    assert sum(f.stat().st_size for f in (CONFIGS / name).iterdir()) < 5 * 2**20
    assert (CONFIGS / name / "tokenizer.json").is_file() and (CONFIGS / name / "tokenizer_config.json").is_file()


TINY = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": False},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "tie_word_embeddings": False},
}


@pytest.mark.parametrize("kind", sorted(TINY))
def test_random_checkpoint_loads_in_transformers_with_no_missing_or_unexpected_tensor(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    make = load_script("make_sized_models")
    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 256, "torch_dtype": "bfloat16", **TINY[kind]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    size = make.write_safetensors(config, tmp_path, seed=3, std=0.02)
    assert size == sum(2 * torch.Size(s).numel() for _, s in make.tensor_shapes(config))

    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    embedding = model.get_input_embeddings().weight.float()
    assert abs(embedding.std().item() - 0.02) < 0.002
    # Seeded per tensor: the same seed writes the same bytes.
    again = tmp_path / "again"
    again.mkdir()
    make.write_safetensors(config, again, seed=3, std=0.02)
    assert (again / "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()


@requires_model
def test_bytes_per_token_counts_every_tensor_and_the_tied_output_matrix():
    from gguf import GGUFReader

    peers = load_script("run_peers")
    counted = peers.gguf_bytes_per_token(MODEL_PATH)
    tensors = {t.name: t for t in GGUFReader(str(MODEL_PATH)).tensors}
    assert "output.weight" not in tensors  # SmolLM2 ties its output matrix to the embedding
    embedding = tensors["token_embd.weight"]
    row = int(embedding.n_bytes) // int(embedding.shape[-1])
    assert counted["bytes_per_token"] == sum(int(t.n_bytes) for t in tensors.values()) + row
    assert counted["kv_reads"] == "excluded" and counted["kv_bytes_per_position"] > 0


def test_each_one_stream_rows_roofline_is_its_own_bandwidth_measure():
    """The fraction of the roofline a one-stream row reached is against the bandwidth measured just after that row
    (a shared machine's rate drifts), and against the run's first measure for a row without its own."""
    peers = load_script("run_peers")
    single = peers.Workload("single", None, 1, [])
    busy = peers.Workload("decode-heavy", None, 8, [])
    servers = [peers.Server("serval", []), peers.Server("llama.cpp", [])]
    results = {
        "serval": {"workloads": {"single": {"summary": {"tpot_ms": {"p50": 25.0}},
                                            "bandwidth": {"bytes_per_s": 40e9}},
                                 "decode-heavy": {"summary": {"tpot_ms": {"p50": 100.0}}}}},
        "llama.cpp": {"workloads": {"single": {"summary": {"tpot_ms": {"p50": 50.0}}}}},
    }
    rows = peers.roofline_rows(results, [single, busy], servers, {"bytes_per_token": 1e9}, {"bytes_per_s": 80e9})
    assert [(r["server"], r["decode_tok_s"], r["fraction"]) for r in rows] == [
        ("serval", 40.0, pytest.approx(1.0)), ("llama.cpp", 20.0, pytest.approx(0.25))]


def test_paired_ratio_is_the_median_of_each_rounds_ratio():
    """--paired-rounds: a server's ratio pairs each of its rounds with the base's round of the same minute, so a
    slow minute for both counts as a tie (a ratio of the medians would not)."""
    peers = load_script("run_peers")
    rates = {"serval": [40.0, 20.0, 44.0, 22.0], "llama.cpp": [40.0, 20.0, 40.0, 20.0]}
    paired = peers.paired_ratios(rates, "llama.cpp")
    assert paired["serval"]["round_ratios"] == [1.0, 1.0, pytest.approx(1.1), pytest.approx(1.1)]
    assert paired["serval"]["ratio_to_llama.cpp"] == pytest.approx(1.05)
    assert paired["llama.cpp"]["ratio_to_llama.cpp"] == 1.0
    assert (paired["serval"]["median"], paired["serval"]["min"], paired["serval"]["max"]) == (31.0, 20.0, 44.0)


def test_a_paired_workload_compares_its_own_metric():
    """--paired-workload: one stream compares decode tok/s (1000 / TPOT p50); the others their first metric, the
    mixed workload its wall (lower is better); a name outside the suite is refused."""
    peers = load_script("run_peers")
    workloads = {w.name: w for w in peers.suite(peers.parse_args(["--workloads", "single,decode-heavy,mixed"]))}
    summary = {"tpot_ms": {"p50": 40.0}, "output_throughput": 75.0, "duration_s": 31.5, "itl_ms": {"p99": 900.0}}
    assert peers.paired_metric(workloads["single"]) == ("decode tok/s", True)
    assert peers.paired_value(workloads["single"], summary) == 25.0
    assert peers.paired_metric(workloads["decode-heavy"]) == ("output tok/s", True)
    assert peers.paired_value(workloads["decode-heavy"], summary) == 75.0
    assert peers.paired_metric(workloads["mixed"]) == ("wall s", False)
    assert peers.paired_value(workloads["mixed"], summary) == 31.5
    assert peers.parse_args(["--paired-rounds", "2", "--paired-workload", "mixed"]).paired_workload == "mixed"
    with pytest.raises(SystemExit):
        peers.parse_args(["--paired-rounds", "2", "--paired-workload", "no-such-workload"])
    with pytest.raises(SystemExit):
        peers.parse_args(["--paired-rounds", "2", "--paired-workload", "single,mixed"])


def test_a_serval_variant_runs_from_the_checkout_it_is_given(tmp_path):
    """--serval-checkout NAME=DIR: that variant imports Serval from DIR (its PYTHONPATH and working directory, where
    `python -m` looks first); the others from this checkout; a DIR that holds no Serval is refused."""
    peers = load_script("run_peers")
    other = tmp_path / "base"
    (other / "serval").mkdir(parents=True)
    (other / "serval" / "__init__.py").write_text("")
    argv = ["run_peers.py", "--serval", "base=", "--serval", "new=--speculative-model none", "--serval-checkout",
            f"base={other}", "--servers", "base,new", "--peers", str(tmp_path / "no-peers")]
    args = peers.parse_args(argv[1:])
    found = {s.name: s for s in peers.servers(args)}
    assert (found["base"].env["PYTHONPATH"], found["base"].cwd) == (str(other), str(other))
    assert (found["new"].env["PYTHONPATH"], found["new"].cwd) == (str(REPO), None)
    assert found["new"].command[-2:] == ["--speculative-model", "none"]
    assert found["base-no-prefix-cache"].workloads == ["shared-prefix"]
    # The copy without the prefix cache runs the shared-prefix workload alone: not started when that is not run.
    without = peers.servers(peers.parse_args(argv[1:] + ["--workloads", "single,mixed"]))
    assert [s.name for s in without] == ["base", "new"]
    with pytest.raises(SystemExit):
        peers.parse_args(["--serval-checkout", f"base={tmp_path}"])
    with pytest.raises(SystemExit):
        peers.parse_args(["--paired-rounds", "0"])
