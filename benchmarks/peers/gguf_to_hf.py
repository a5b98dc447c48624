"""Writes the embedded GGUF model as a Hugging Face directory (safetensors + config + tokenizer), for peers
such as vLLM that load only that form. transformers dequantizes the GGUF; the weights are saved in bfloat16.

    .venv/bin/python benchmarks/peers/gguf_to_hf.py OUT_DIR
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from serval.model.registry import resolve_model_path


def main() -> None:
    out = sys.argv[1]
    path = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    # A GGUF-loaded model counts as "quantized" and refuses to save: copy its (dequantized) weights into a plain one.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
