"""A prompt that tokenizes to zero ids is refused with a 400 naming the prompt, never queued: nothing could ever run
it (issue 51: such a request waited for ever with prompt_tokens 0). Through the official client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from front_end_only import FrontEndOnly

from serval.server.app import create_app
from serval.server.config import ServerConfig
from serval.tokenizer import Tokenizer

MODEL = "words"


def word_tokenizer() -> Tokenizer:
    """A tokenizer of whole words split at white space: a prompt of spaces alone is no tokens."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "Name", "a", "river"]
    rust = RustTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    rust.pre_tokenizer = Whitespace()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                             unk_token="<unk>"))


def test_a_prompt_of_zero_tokens_is_a_400_and_is_never_queued():
    tokenizer = word_tokenizer()
    assert tokenizer.encode("   \t ") == [] and tokenizer.encode("Name a river") == [3, 4, 5]
    engine = FrontEndOnly(tokenizer, MODEL, vocab_size=6)

    async def ask(prompt):
        transport = httpx.ASGITransport(app=create_app(engine, ServerConfig(served_model_name=MODEL)))
        async with openai.AsyncOpenAI(api_key="none", base_url="http://serval/v1", max_retries=0,
                                      http_client=httpx.AsyncClient(transport=transport)) as client:
            return await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)

    for prompt in ("   \t ", [], ""):
        with pytest.raises(openai.BadRequestError) as info:
            asyncio.run(ask(prompt))
        assert info.value.status_code == 400 and info.value.param == "prompt", prompt
        if prompt == "   \t ":
            assert "prompt is no tokens once tokenized" in info.value.message
    assert engine.queued == []
