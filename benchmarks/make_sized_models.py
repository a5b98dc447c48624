"""Random-weight models of published sizes, as llama.cpp's own tools would make them from a real checkpoint.

Given a config directory (or a name in benchmarks/configs/), writes, under OUT_ROOT/NAME/:

    hf/               a Hugging Face directory: the config, the bundled tokenizer, bf16 safetensors of seeded
                      normal weights (std 0.02; norms 1), written tensor by tensor, so memory stays near the
                      largest tensor (the embedding), never the model
    NAME-Q8_0.gguf    llama.cpp's convert_hf_to_gguf.py --outtype q8_0 on hf/
    NAME-Q4_K_M.gguf  llama-quantize --allow-requantize from the Q8_0 file: a bf16 GGUF beside hf/ would need twice
                      the bf16 size on disk (32 GB for an 8B). The tensor types are Q4_K_M's; the values are rounded
                      twice, which does not matter for random weights

hf/ is deleted once the GGUFs exist, and the Q8_0 file when it was made only to make the Q4_K_M (--keep-hf,
--keep-q8 keep them). The tools come from `bash benchmarks/peers/setup.sh` (PEERS/llamacpp/src: the
llama-cpp-python sdist with llama.cpp vendored; PEERS/llamacpp/bin/llama-quantize).

    .venv/bin/python benchmarks/make_sized_models.py Llama-3.2-1B                  # Q4_K_M and Q8_0
    .venv/bin/python benchmarks/make_sized_models.py Llama-3.1-8B --quants Q4_K_M  # 16 GB of disk at the peak
    .venv/bin/python benchmarks/make_sized_models.py Llama-3.2-1B --quants none --keep-hf  # only hf/ (vLLM)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "benchmarks" / "configs"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHARD_BYTES = 5 * 2**30  # Hugging Face's default shard size


_EXPERTS = {"mixtral": ("block_sparse_moe", "num_local_experts", "intermediate_size", ("w1", "w3", "w2")),
            "qwen3_moe": ("mlp", "num_experts", "moe_intermediate_size", ("gate_proj", "up_proj", "down_proj"))}


def tensor_shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors, (name, shape), in the published checkpoints' naming, for the model types of
    benchmarks/configs/: llama, mistral, qwen2, qwen3 (dense), mixtral and qwen3_moe (MoE)."""
    kind = config["model_type"]
    if kind not in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"):
        raise ValueError(f"model_type {kind!r}: not one this script knows how to lay out")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "self_attn.q_proj.weight", (heads * head_dim, hidden)
        yield p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)
        yield p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)
        yield p + "self_attn.o_proj.weight", (hidden, heads * head_dim)
        if config.get("attention_bias") or kind == "qwen2":
            yield p + "self_attn.q_proj.bias", (heads * head_dim,)
            yield p + "self_attn.k_proj.bias", (kv_heads * head_dim,)
            yield p + "self_attn.v_proj.bias", (kv_heads * head_dim,)
        if kind in ("qwen3", "qwen3_moe"):
            yield p + "self_attn.q_norm.weight", (head_dim,)
            yield p + "self_attn.k_norm.weight", (head_dim,)
        sparse = kind == "mixtral" or (kind == "qwen3_moe" and i not in config.get("mlp_only_layers", [])
                                         and (i + 1) % config.get("decoder_sparse_step", 1) == 0)
        if sparse:
            # (the MLP's prefix, the experts' count and width, their gate, up and down names), as each family names
            mlp, count, width, (gate, up, down) = _EXPERTS[kind]
            experts, inter = config[count], config[width]
            yield f"{p}{mlp}.gate.weight", (experts, hidden)
            for e in range(experts):
                q = f"{p}{mlp}.experts.{e}."
                yield q + f"{gate}.weight", (inter, hidden)
                yield q + f"{up}.weight", (inter, hidden)
                yield q + f"{down}.weight", (hidden, inter)
        else:
            inter = config["intermediate_size"]
            yield p + "mlp.gate_proj.weight", (inter, hidden)
            yield p + "mlp.up_proj.weight", (inter, hidden)
            yield p + "mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    if not config.get("tie_word_embeddings", False):
        yield "lm_head.weight", (vocab, hidden)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """bf16 N(0, std) for matrices, ones for norms, zeros for biases; each tensor from its own seed (the run's seed
    and its name), so a tensor's values do not depend on the others."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, 2**26 // max(1, _numel(shape[1:])))  # ~256 MB of float32 at a time
    for start in range(0, shape[0], rows):
        out[start:start + rows] = torch.randn((min(rows, shape[0] - start), *shape[1:]), generator=generator) * std
    return out


def _safetensors_header(entries: list[tuple[str, tuple[int, ...]]]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        size = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(config: dict, out: Path, seed: int, std: float) -> int:
    """The weights as bf16 safetensors shards (and their index when more than one), one tensor in memory at a
    time: the safetensors header lists every tensor's offset up front, so the data can be streamed after it.
    Returns the bytes written."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(config):
        if shards[-1] and size + 2 * _numel(shape) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += 2 * _numel(shape)
    total = sum(2 * _numel(s) for shard in shards for _, s in shard)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    written, shown, started = 0, 0, time.perf_counter()
    for file_name, shard in zip(names, shards):
        with open(out / file_name, "wb") as f:
            f.write(_safetensors_header(shard))
            for name, shape in shard:
                # bf16 bytes as int16 through numpy: numpy has no bfloat16
                f.write(random_tensor(name, shape, seed, std).view(torch.int16).numpy().data)  # no copy
                written += 2 * _numel(shape)
                if written - shown >= 2**29 or name == shard[-1][0]:  # every 512 MiB and at each shard's end
                    shown = written
                    rate = written / 2**20 / (time.perf_counter() - started)
                    print(f"   {file_name}: {written / 2**30:.2f} / {total / 2**30:.2f} GiB ({rate:.0f} MiB/s)",
                          flush=True)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file_name for file_name, shard in zip(names, shards) for name, _ in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def write_tokenizer(out: Path) -> None:
    """The embedded SmolLM2 tokenizer as Hugging Face files (as benchmarks/peers/gguf_to_hf.py writes it), for a
    config directory that lacks them."""
    from transformers import AutoTokenizer

    from serval.model.registry import resolve_model_path

    path = resolve_model_path(None)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # "TokenizersBackend" is transformers 5's name only
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def _size(path: Path) -> str:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    return f"{size / 2**30:.2f} GiB ({size:,} bytes)"


def _run(command: list[str], env: dict | None = None) -> None:
    """Runs a long tool, its output shown as it comes; fails loudly with its exit status."""
    print("   $ " + " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, **(env or {})})
    print(f"   done in {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a directory with config.json, or a name in benchmarks/configs/ ("
                        + ", ".join(sorted(p.name for p in CONFIGS.iterdir() if p.is_dir())) + ")")
    parser.add_argument("--out-root", default=str(ROOT.parent / "models"),
                        help="NAME/ is made under it (default: ../models, beside the repository)")
    parser.add_argument("--quants", default="Q4_K_M,Q8_0",
                        help="comma-separated GGUF types to make: Q4_K_M, Q8_0; none: only the HF directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="the weights' standard deviation")
    parser.add_argument("--peers", default=str(ROOT.parent / "peers"), help="where benchmarks/peers/setup.sh "
                        "put llama.cpp")
    parser.add_argument("--keep-hf", action="store_true", help="keep the bf16 HF directory (vLLM's input)")
    parser.add_argument("--keep-q8", action="store_true", help="keep the Q8_0 file when only Q4_K_M was asked")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama-quantize's threads (default: the cores this process may use)")
    args = parser.parse_args()

    source = Path(args.model) if Path(args.model).is_dir() else CONFIGS / args.model
    if not (source / "config.json").is_file():
        parser.error(f"{args.model}: no config.json there, nor in {CONFIGS}")
    quants = [] if args.quants == "none" else args.quants.split(",")
    if unknown := set(quants) - {"Q4_K_M", "Q8_0"}:
        parser.error(f"--quants: {sorted(unknown)} not among Q4_K_M, Q8_0")
    name = source.resolve().name
    out = Path(args.out_root) / name
    hf = out / "hf"
    llama_src = Path(args.peers) / "llamacpp" / "src" / "vendor" / "llama.cpp"
    quantize = Path(args.peers) / "llamacpp" / "bin" / "llama-quantize"
    if quants and not (llama_src / "convert_hf_to_gguf.py").is_file():
        parser.error(f"{llama_src}/convert_hf_to_gguf.py missing: run bash benchmarks/peers/setup.sh")
    if "Q4_K_M" in quants and not quantize.exists():
        parser.error(f"{quantize} missing: run bash benchmarks/peers/setup.sh")
    config = json.loads((source / "config.json").read_text())
    params = sum(_numel(shape) for _, shape in tensor_shapes(config))
    print(f"{name}: {params / 1e9:.2f}B parameters, {2 * params / 2**30:.2f} GiB in bf16 -> {out}", flush=True)

    q8 = out / f"{name}-Q8_0.gguf"
    q4 = out / f"{name}-Q4_K_M.gguf"
    if (hf / "config.json").is_file() and any(hf.glob("*.safetensors")) and not (hf / ".partial").exists():
        print(f"1. {hf}: already there", flush=True)
    elif quants and (q8.is_file() or all((out / f"{name}-{q}.gguf").is_file() for q in quants)):
        print("1. HF directory: not needed (every GGUF is made from the Q8_0 file, which exists)", flush=True)
    else:
        print(f"1. writing {hf} (seed {args.seed}, std {args.std})", flush=True)
        hf.mkdir(parents=True, exist_ok=True)
        (hf / ".partial").touch()  # until the weights are complete: a killed run is not taken as done
        shutil.copy(source / "config.json", hf)
        if all((source / f).is_file() for f in TOKENIZER_FILES[:2]):
            for f in TOKENIZER_FILES:
                if (source / f).is_file():
                    shutil.copy(source / f, hf)
        else:
            write_tokenizer(hf)
        write_safetensors(config, hf, args.seed, args.std)
        (hf / ".partial").unlink()
        print(f"   {hf}: {_size(hf)}", flush=True)

    if quants and not q8.is_file():
        print(f"2. {q8.name}: llama.cpp's convert_hf_to_gguf.py --outtype q8_0", flush=True)
        partial = q8.with_suffix(".partial")
        _run([sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "q8_0",
              "--outfile", str(partial)], env={"PYTHONPATH": str(llama_src / "gguf-py")})
        partial.rename(q8)
    if q8.is_file():
        print(f"   {q8}: {_size(q8)}", flush=True)
    if "Q4_K_M" in quants and not q4.is_file():
        print(f"3. {q4.name}: llama-quantize --allow-requantize from Q8_0", flush=True)
        partial = q4.with_suffix(".partial")
        _run([str(quantize), "--allow-requantize", str(q8), str(partial), "Q4_K_M", str(args.threads)])
        partial.rename(q4)
    if q4.is_file():
        print(f"   {q4}: {_size(q4)}", flush=True)

    if quants and hf.is_dir() and not args.keep_hf:
        shutil.rmtree(hf)
        print(f"removed {hf} (--keep-hf keeps it)", flush=True)
    if "Q8_0" not in quants and q8.is_file() and not args.keep_q8:
        q8.unlink()
        print(f"removed {q8} (--keep-q8 keeps it)", flush=True)
    print("made:", flush=True)
    for path in sorted(out.iterdir()):
        print(f"   {path}: {_size(path)}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from a checkout: this repository's serval, for write_tokenizer
    main()
