"""`serval serve --model DIR` on a Hugging Face safetensors directory of each architecture (tiny random Llama 3,
Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Mixtral and Qwen3-MoE models with SmolLM2's tokenizer beside them): one
streamed chat each through the official openai client answers transformers' greedy text, with the directory's chat
template and its stop tokens."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from real_model import MODEL_PATH, requires_model
from serverproc import Server, streamed_chat
from tiny_models import FAMILY_OVERRIDES, save_family_dir

from serval.tokenizer import Tokenizer

pytestmark = requires_model  # the tokenizer (and its chat template) is the embedded SmolLM2's

CHAT = [{"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Which river runs through Paris, and where does it meet the sea?"}]
MAX_TOKENS = 12


def _stop_position(tokens: list[int], eos: int) -> int:
    """Where to make the reference's own greedy continuation stop: the first token from the fourth on that appears
    nowhere before it (so a stop id there ends the answer exactly there)."""
    return next(k for k in range(3, len(tokens)) if tokens[k] != eos and tokens[k] not in tokens[:k])


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    """family -> (its server, the chat's prompt length through the directory's template as transformers renders
    it, transformers' greedy tokens up to and with the stop id, their text), for the families whose test this run
    selected; every server starts before any is waited for, so their loads overlap."""
    selected = [item.callspec.params["family"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    tokenizer = Tokenizer.load(MODEL_PATH)
    hf_tokenizer = tokenizer.hf_tokenizer
    eos = hf_tokenizer.eos_token_id
    prompt = hf_tokenizer(hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt])
    launched = {}
    try:
        for family in selected:
            directory = tmp_path_factory.mktemp(family)
            hf = save_family_dir(directory, family, hf_tokenizer)
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos)
            tokens = out[0, len(prompt):].tolist()
            stop = _stop_position(tokens, eos)
            # The directory's own end-of-sequence ids: the tokenizer's, and one the model really generates.
            (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, tokens[stop]]}))
            server = Server(["--model", str(directory), "--kv-cache-memory", "0.05"],
                            directory.parent / f"{family}.log")
            launched[family] = (server.start(), len(prompt), tokens[:stop + 1],
                                tokenizer.decode(tokens[:stop + 1]))
        yield launched
    finally:
        for server, *_ in launched.values():  # all at once: their shutdowns overlap
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
        for server, *_ in launched.values():
            server.stop()


@pytest.mark.parametrize("family", list(FAMILY_OVERRIDES))
def test_a_streamed_chat_answers_transformers_greedy_text_and_stops_at_the_directorys_stop_id(served, family):
    server, prompt_tokens, want, want_text = served[family]
    chunks, text, finish = streamed_chat(server.wait_ready().client(), CHAT, MAX_TOKENS)
    # The stop id is an ordinary token here, so its text is part of the answer (the engine skips only special
    # tokens' text); the answer ends there, before max_tokens, as a stop.
    assert text == want_text
    assert finish == ["stop"] and chunks[-1].usage.completion_tokens == len(want) < MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert f"loaded {family} model" in server.log()
