"""`serval serve --model DIR` on a GPTQ checkpoint (a tiny random Llama whose linears are packed as 4-bit GPTQ from
known integers, SmolLM2's tokenizer beside it): one streamed chat answers transformers' greedy text on the same
dequantized weights, the linears read as the CPU kernel's 4-bit blocks."""

from __future__ import annotations

import pytest
import torch
from real_model import MODEL_PATH, requires_model
from serverproc import Server, streamed_chat
from tiny_models import save_family_dir
from tiny_quantized import QuantSpec, save_quantized_dir

from serval.tokenizer import Tokenizer

pytestmark = requires_model  # the tokenizer (and its chat template) is the embedded SmolLM2's

CHAT = [{"role": "user", "content": "Which river runs through Paris?"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the server, transformers' greedy tokens, their text)."""
    hf_tokenizer = Tokenizer.load(MODEL_PATH).hf_tokenizer
    directory = tmp_path_factory.mktemp("llama-gptq")
    # Symmetric GPTQ: its blocks are exact, so transformers on the documented weights is the reference.
    hf = save_quantized_dir(directory, save_family_dir(directory, "llama", hf_tokenizer),
                            QuantSpec("gptq", 32, sym=True))
    prompt = hf_tokenizer(hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt])
    eos = hf_tokenizer.eos_token_id
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                          eos_token_id=eos, pad_token_id=eos)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == MAX_TOKENS and eos not in tokens  # this seed's answer runs to max_tokens
    # Float activations: transformers' greedy text on a tiny random model, whose near-ties int8 activations ("auto" on
    # some CPUs) decide their own way (their cost on real models: benchmarks/README.md, "Int8 activations by default
    # where they measure faster").
    server = Server(["--model", str(directory), "--kv-cache-memory", "0.05", "--activation-quantization", "none"],
                    directory.parent / "llama-gptq.log")
    try:
        yield server.start(), tokens, hf_tokenizer.decode(tokens)
    finally:
        server.stop()


def test_a_streamed_chat_on_a_gptq_checkpoint_answers_transformers_greedy_text(served):
    server, want, want_text = served
    chunks, text, finish = streamed_chat(server.wait_ready().client(), CHAT, MAX_TOKENS)
    assert text == want_text
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == len(want)
    log = server.log()
    assert "loaded llama model" in log and "weights gptq" in log
    assert "linears read the gptq checkpoint's 4-bit groups as blocks" in log
