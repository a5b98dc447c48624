"""Loading holds the model in about the memory its file takes (issue: real sizes), and --load-format dummy serves a
model's shape from its config.json alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from real_model import MODEL_PATH, requires_model
from tiny_models import TINY
from transformers import LlamaConfig

from serval.layers.embedding import BlockEmbedding
from serval.layers.linear import BlockQuantLinear, Linear
from serval.model import loader

ROOT = Path(__file__).resolve().parents[2]

# Run in a process of its own, so that the peak is this load's: everything but the model (torch, the C++ kernels)
# is in memory before the baseline is read.
_MEASURE = """
import json, sys, torch
from pathlib import Path
from serval.layers import cpu_kernels
from serval.model.loader import load_model
cpu_kernels.for_device(torch.device("cpu"))

def peak_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

before = peak_mib()
model = load_model(Path(sys.argv[1]), torch.bfloat16)
print(json.dumps({"grew_mib": peak_mib() - before}))
"""


@requires_model
def test_loading_the_embedded_gguf_takes_about_the_files_size():
    """The peak memory that loading adds is the file's size (94 MiB here) and a constant, not 4 bytes a parameter:
    blocks go from the file into the kernel's layout and are held once. Measured on an AMD Zen 4: 321 MiB, of which
    about 75 are torch's code pages that the first calls of its ops touch and one tensor's transient copies; the
    loader before this measured 816 MiB."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(MODEL_PATH)], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    grew = json.loads(out.stdout.strip().splitlines()[-1])["grew_mib"]
    file_mib = MODEL_PATH.stat().st_size / 2**20
    assert grew <= 1.25 * file_mib + 256, (grew, file_mib)


@requires_model
def test_a_gguf_s_blocks_are_read_as_blocks_embedding_included(smollm):
    """What users get (--quantization auto on the CPU): every linear and the embedding read the file's blocks; no
    dense matrix is made for them."""
    model, _ = smollm("bfloat16")
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert not [name for name, module in model.named_modules() if type(module) is Linear]
    assert all(isinstance(layer.self_attn.qkv_proj, BlockQuantLinear) for layer in model.layers)


@requires_model
@torch.inference_mode()
def test_the_embedding_in_blocks_gives_the_dense_tables_rows(smollm):
    """The rows of the block embedding are the dequantized file's, rounded once to the dtype: those of the dense
    table --quantization none loads from the same file."""
    blocks, _ = smollm("bfloat16")
    dense, _ = smollm("float32", "none")
    ids = torch.tensor([0, 1, 17, 1000, 49151])
    assert torch.equal(blocks.embed_tokens(ids), dense.embed_tokens(ids).to(torch.bfloat16))


def _config_only(directory: Path) -> Path:
    LlamaConfig(**TINY).save_pretrained(directory)
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    return directory


@torch.inference_mode()
def test_dummy_weights_need_only_a_config_and_are_the_same_each_load(tmp_path):
    directory = _config_only(tmp_path)
    first = loader.load_model(directory, torch.bfloat16, load_format="dummy")
    again = loader.load_model(directory, torch.bfloat16, load_format="dummy")
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert first.embed_tokens.weight.dtype == torch.bfloat16
    assert first.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.1)
    hidden = first.embed_tokens(torch.arange(8))
    for layer in first.layers:
        hidden = layer.mlp(hidden)
    assert torch.isfinite(hidden).all()


def test_dummy_weights_refuse_the_quantizations_that_need_a_file(tmp_path):
    directory = _config_only(tmp_path)
    with pytest.raises(ValueError, match="--load-format dummy"):
        loader.load_model(directory, torch.bfloat16, quantization="gguf", load_format="dummy")
    assert loader.resolve_quantization(directory, "cpu", torch.bfloat16, "auto", dummy=True) == "none"


@requires_model
def test_serval_generate_runs_a_config_only_directory_with_dummy_weights(tmp_path):
    """The command users run: a directory with a config.json and a tokenizer, no weights."""
    from serval.tokenizer import Tokenizer

    Tokenizer.load(MODEL_PATH).hf_tokenizer.save_pretrained(tmp_path)
    config = LlamaConfig(**{**TINY, "vocab_size": 49152})
    config.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    out = subprocess.run([sys.executable, "-m", "serval.cli", "generate", "--model", str(tmp_path), "--load-format",
                          "dummy", "--max-tokens", "4", "--raw", "Hello"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "4 tokens" in out.stderr + out.stdout, out.stderr[-2000:]
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 49152
