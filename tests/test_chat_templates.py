"""Each model's own chat template and stop tokens, from its files: a Hugging Face directory's template from
chat_template.jinja, chat_template.json or tokenizer_config.json and its end-of-sequence ids from
generation_config.json and config.json merged; a GGUF file's tokenizer.chat_template and eos/eot ids. The stop set
reaches the engine (a forced token from it ends the answer). Without a template: a named fallback, in the log and
/v1/models, and chats still served. Tiny random Llamas with SmolLM2's tokenizer (or a word-level one of its own)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from real_model import MODEL_PATH, requires_model
from tiny_models import gguf_tokenizer_fields, save_family_dir, tiny_family, write_gguf

from serval.config import CacheConfig, EngineConfig
from serval.engine.async_engine import AsyncEngine
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM
from serval.model.loader import load_model
from serval.sampling_params import SamplingParams
from serval.server.app import create_app
from serval.tokenizer import CHATML_FALLBACK, GEMMA_CHAT_TEMPLATE, PLAIN_FALLBACK, Tokenizer

pytestmark = requires_model  # SmolLM2's tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
# A template no model ships, so that a prompt rendered by it can only come from the model's files.
CUSTOM = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}[assistant]{% endif %}")
CUSTOM_TEXT = "[system] Be brief.\n[user] Name a river.\n[assistant]"
# Ordinary tokens that the tests make end-of-sequence ids (the second of a list), or force as a control.
SECOND_EOS, CONFIG_EOS, NOT_EOS = 1000, 1001, 1002


@pytest.fixture(scope="module")
def hf_tokenizer():
    return Tokenizer.load(MODEL_PATH).hf_tokenizer


def _model_dir(directory: Path, hf_tokenizer, template_file: str | None = None) -> Path:
    """A tiny Llama directory with SmolLM2's tokenizer, its chat template only in ``template_file`` (None: nowhere)."""
    save_family_dir(directory, "llama", hf_tokenizer)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template_file == "tokenizer_config.json":
        config["chat_template"] = CUSTOM
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file == "chat_template.jinja":
        (directory / "chat_template.jinja").write_text(CUSTOM)
    elif template_file == "chat_template.json":
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": CUSTOM}))
    return directory


def _set_eos(directory: Path, file: str, eos) -> None:
    path = directory / file
    raw = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**raw, "eos_token_id": eos}))


def _llm(path: Path, tokenizer: Tokenizer) -> LLM:
    config = EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(num_blocks=64))
    return LLM.from_engine(LLMEngine(config, model=load_model(path, torch.float32), tokenizer=tokenizer))


def _forced(llm: LLM, token: int, max_tokens: int = 4):
    """The chat's answer when ``token`` is forced at every step (a logit bias no other logit comes near)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias={token: 100.0})
    return llm.chat([CHAT], params, use_tqdm=False)[0]


@pytest.mark.parametrize("template_file", ["chat_template.jinja", "chat_template.json", "tokenizer_config.json"])
def test_a_directory_chat_template_is_read_from_where_it_is_saved(tmp_path, hf_tokenizer, template_file) -> None:
    tokenizer = Tokenizer.load(_model_dir(tmp_path, hf_tokenizer, template_file))
    assert tokenizer.chat_template_source == template_file
    assert tokenizer.render_chat(CHAT) == CUSTOM_TEXT
    assert tokenizer.apply_chat_template(CHAT) == tokenizer.encode(CUSTOM_TEXT, add_special_tokens=False)


def test_the_directory_template_and_eos_list_reach_the_engine(tmp_path, hf_tokenizer) -> None:
    """generation_config.json lists two eos ids (as Llama 3's <|eot_id|>, <|end_of_text|>), config.json a third:
    all three stop a chat rendered by the directory's own template; a forced token outside them does not."""
    directory = _model_dir(tmp_path, hf_tokenizer, "chat_template.jinja")
    _set_eos(directory, "generation_config.json", [2, SECOND_EOS])
    _set_eos(directory, "config.json", [2, CONFIG_EOS])
    tokenizer = Tokenizer.load(directory)
    assert tokenizer.eos_token_ids == {2, SECOND_EOS, CONFIG_EOS}
    llm = _llm(directory, tokenizer)
    assert set(llm.engine.inputs.eos_token_ids) == {2, SECOND_EOS, CONFIG_EOS}  # the set each request carries
    for eos in (SECOND_EOS, CONFIG_EOS):
        output = _forced(llm, eos)
        assert output.prompt_token_ids == tokenizer.encode(CUSTOM_TEXT, add_special_tokens=False)
        assert (output.outputs[0].token_ids, output.outputs[0].finish_reason) == ([eos], "stop")
    control = _forced(llm, NOT_EOS).outputs[0]
    assert (control.token_ids, control.finish_reason) == ([NOT_EOS] * 4, "length")


def test_without_a_template_chatml_is_the_named_fallback_and_chats_are_served(tmp_path, hf_tokenizer,
                                                                              caplog) -> None:
    """SmolLM2's vocabulary has <|im_start|> and <|im_end|>: ChatML, named in the log and /v1/models; a chat
    through the server renders by it, and <|im_end|> ends a turn."""
    directory = _model_dir(tmp_path, hf_tokenizer)
    # Every file names <|endoftext|> as the end: <|im_end|> ends a turn only through the fallback.
    _set_eos(directory, "generation_config.json", 0)
    _set_eos(directory, "config.json", 0)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>",
                                                                 "pad_token": "<|endoftext|>"}))
    with caplog.at_level("WARNING", logger="serval.tokenizer"):
        tokenizer = Tokenizer.load(directory)
    assert tokenizer.chat_template_source == CHATML_FALLBACK
    assert f"{directory}: the model's files carry no chat template; chats use the {CHATML_FALLBACK}" in caplog.text
    chatml = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a river.<|im_end|>\n"
              "<|im_start|>assistant\n")
    assert tokenizer.render_chat(CHAT) == chatml
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_ids == {0, im_end}

    engine = LLMEngine(EngineConfig(model=str(directory), dtype="float32", cache=CacheConfig(num_blocks=64)),
                       model=load_model(directory, torch.float32), tokenizer=tokenizer)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    app = create_app(async_engine)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serval") as client:
            models = (await client.get("/v1/models")).json()["data"][0]
            assert models["chat_template"] == CHATML_FALLBACK
            body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "logit_bias": {str(im_end): 100}}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["usage"]["prompt_tokens"] == len(tokenizer.encode(chatml, add_special_tokens=False))
            assert (answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]) == ("stop", 1)

    try:
        asyncio.run(scenario())
    finally:
        async_engine.shutdown()


def test_without_chatml_tokens_the_fallback_is_plain_role_lines(tmp_path, caplog) -> None:
    """A vocabulary of its own (words, <s>, </s>): no ChatML tokens, so "role: content" lines after BOS."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "system", "user", "assistant", ":", "Be", "brief", ".", "Name", "a", "river"]
    rust = RustTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    rust.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(tmp_path)
    tiny_family("llama", vocab_size=len(words), bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="serval.tokenizer"):
        tokenizer = Tokenizer.load(tmp_path)
    assert tokenizer.chat_template_source == PLAIN_FALLBACK
    assert f"{tmp_path}: the model's files carry no chat template; chats use the {PLAIN_FALLBACK}" in caplog.text
    assert tokenizer.render_chat(CHAT) == "<s>system: Be brief.\nuser: Name a river.\nassistant:"
    output = _llm(tmp_path, tokenizer).chat([CHAT], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert output.prompt_token_ids == tokenizer.apply_chat_template(CHAT)
    assert output.prompt_token_ids[0] == 1 and output.outputs[0].token_ids


def _gguf(path: Path, template: str | None, eot: int | None, family: str = "llama") -> Path:
    """A tiny GGUF of ``family`` with SmolLM2's tokenizer fields, its chat template replaced (None: left out) and an
    end-of-turn id added to the header."""
    fields = [f for f in gguf_tokenizer_fields(MODEL_PATH) if f[0] != "tokenizer.chat_template"]
    import gguf

    if template is not None:
        fields.append(("tokenizer.chat_template", template, gguf.GGUFValueType.STRING, None))
    if eot is not None:
        fields.append(("tokenizer.ggml.eot_token_id", eot, gguf.GGUFValueType.UINT32, None))
    shape = {"head_dim": 16, "tie_word_embeddings": True} if family == "gemma2" else {}
    write_gguf(path, tiny_family(family, vocab_size=49152, bos_token_id=1, eos_token_id=2, **shape), "F32",
               tokenizer=fields)
    return path


def test_a_gguf_header_gives_the_template_and_the_stop_ids(tmp_path) -> None:
    """The header's template renders the chat; its eos (<|im_end|>) and eot ids and the vocabulary's end-of-turn
    tokens (<|endoftext|>, which llama.cpp stops at too) make the stop set, and the eot id stops the engine."""
    path = _gguf(tmp_path / "tiny.gguf", CUSTOM, SECOND_EOS)
    tokenizer = Tokenizer.load(path)
    assert tokenizer.chat_template_source == "tokenizer.chat_template in the GGUF header"
    assert tokenizer.render_chat(CHAT) == CUSTOM_TEXT
    endoftext = tokenizer.hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_ids == {2, SECOND_EOS, endoftext}
    llm = _llm(path, tokenizer)
    output = _forced(llm, SECOND_EOS)
    assert output.prompt_token_ids == tokenizer.encode(CUSTOM_TEXT, add_special_tokens=False)
    assert (output.outputs[0].token_ids, output.outputs[0].finish_reason) == ([SECOND_EOS], "stop")


def test_a_gguf_without_a_template_logs_its_fallback(tmp_path, caplog) -> None:
    path = _gguf(tmp_path / "bare.gguf", None, None)
    with caplog.at_level("WARNING", logger="serval.tokenizer"):
        tokenizer = Tokenizer.load(path)
    assert tokenizer.chat_template_source == CHATML_FALLBACK
    assert f"{path}: the model's files carry no chat template; chats use the {CHATML_FALLBACK}" in caplog.text
    assert tokenizer.render_chat(CHAT).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_a_gemma2_gguf_without_a_template_gets_gemmas_turns(tmp_path, caplog) -> None:
    """Gemma's GGUF files often carry no template: Gemma 2's (as Gemma 3's) get Gemma's turn format, and no warning."""
    path = _gguf(tmp_path / "gemma2.gguf", None, None, family="gemma2")
    with caplog.at_level("WARNING", logger="serval.tokenizer"):
        tokenizer = Tokenizer.load(path)
    assert tokenizer.chat_template_source == "Serval's Gemma template (the GGUF header has none)"
    assert tokenizer.chat_template == GEMMA_CHAT_TEMPLATE and "no chat template" not in caplog.text
    assert "<start_of_turn>user\nBe brief.\n\nName a river.<end_of_turn>\n" in tokenizer.render_chat(CHAT)


def test_named_templates_render_the_default_and_offer_tools(tmp_path, hf_tokenizer) -> None:
    """A tokenizer_config.json with a list of named templates (transformers reads it as a dict): chats render by
    "default", and tools count as rendered when any of them takes a ``tools`` list."""
    directory = _model_dir(tmp_path, hf_tokenizer)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": CUSTOM},
                               {"name": "tool_use", "template": "{{ tools | length }} tools"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.load(directory)
    assert tokenizer.chat_template_source == "tokenizer_config.json"
    assert tokenizer.render_chat(CHAT) == CUSTOM_TEXT
    assert tokenizer.chat_template_renders_tools
