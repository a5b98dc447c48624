"""Tokenizer and streaming detokenizer against the real default GGUF (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import copy
import json

import pytest

from serval.model.registry import resolve_model_path
from serval.tokenizer import CHATML_FALLBACK, CHATML_TEMPLATE, IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.slow  # the real embedded GGUF

KOREAN = "서울은 한국의 수도입니다"
EMOJI = "🦊👍🏽"
QUESTION = [{"role": "user", "content": "What is the capital city of Korea?"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    try:
        path = resolve_model_path(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return Tokenizer.load(path)


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, **kwargs) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt or [], **kwargs)
    deltas = [detok.add(i) for i in ids]
    assert detok.token_ids == ids
    assert detok.text == "".join(deltas)
    return deltas, detok.text


@pytest.mark.parametrize(
    "text",
    ["Hello, world! How are you today?", KOREAN, EMOJI, f"Seoul ({KOREAN}) is lovely {EMOJI}\n\tnew line  two spaces"],
)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert 2 in tok.eos_token_ids  # <|im_end|> ends an assistant turn
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.decode([2]) == ""


def test_chat_template_matches_transformers(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template(QUESTION)
    expected = tok.hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    assert ids == list(expected)
    text = tok.render_chat(QUESTION)
    assert "<|im_start|>user\nWhat is the capital city of Korea?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_uses_given_system_prompt(tok: Tokenizer) -> None:
    default = tok.render_chat(QUESTION)
    assert "SmolLM" in default  # the template's built-in system prompt when none is given
    text = tok.render_chat([{"role": "system", "content": "You are a pirate."}, *QUESTION])
    assert text.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>\n")
    assert "SmolLM" not in text


def test_chat_template_renders_every_turn(tok: Tokenizer) -> None:
    history = [
        *QUESTION,
        {"role": "assistant", "content": "Seoul."},
        {"role": "user", "content": "And of Japan?"},
    ]
    text = tok.render_chat(history)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital city of Korea?<|im_end|>\n"
        "<|im_start|>assistant\nSeoul.<|im_end|>\n"
        "<|im_start|>user\nAnd of Japan?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tok.render_chat(history, add_generation_prompt=False).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "messages[0]"),
        ([{"content": "hi"}], "missing 'role'"),
        ([{"role": "user"}], "missing 'content'"),
        ([{"role": 1, "content": "hi"}], "role must be a string"),
        ([*QUESTION, {"role": "user", "content": None}], "messages[1].content must be a string"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "content must be a string"),
    ],
)
def test_malformed_messages_raise(tok: Tokenizer, messages, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        tok.apply_chat_template(messages)


def test_no_chat_template_raises(tok: Tokenizer) -> None:
    plain = copy.copy(tok)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template(QUESTION)


def test_stream_korean_and_emoji_never_emits_broken_text(tok: Tokenizer) -> None:
    text = f"The capital is Seoul. {KOREAN} {EMOJI} done."
    ids = tok.encode(text)
    deltas, streamed = stream(tok, ids, tok.apply_chat_template(QUESTION))
    assert all("\ufffd" not in d for d in deltas)
    assert streamed == tok.decode(ids) == text
    assert "" in deltas  # some tokens were only parts of a character


def test_stream_holds_back_a_split_character(tok: Tokenizer) -> None:
    ids = tok.encode("🦊")
    assert len(ids) == 3  # byte-level BPE splits the 4 UTF-8 bytes over 3 tokens
    assert tok.decode(ids[:1]).endswith("\ufffd")
    deltas, _ = stream(tok, tok.encode("a") + ids)
    assert deltas == ["a", "", "", "🦊"]


def test_stream_first_token_and_leading_spaces(tok: Tokenizer) -> None:
    ids = tok.encode("The capital is Seoul.")
    deltas, _ = stream(tok, ids, tok.apply_chat_template(QUESTION))
    assert deltas == ["The", " capital", " is", " Seoul", "."]


def test_stream_special_tokens(tok: Tokenizer) -> None:
    ids = [*tok.encode("Seoul."), 2]
    assert stream(tok, ids)[1] == "Seoul."
    assert stream(tok, ids, skip_special_tokens=False)[1] == "Seoul.<|im_end|>"


def test_stream_flush_returns_held_back_text(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [])
    for i in tok.encode("ok🦊")[:-1]:  # the output stops mid-character
        detok.add(i)
    assert detok.text == "ok"
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok\ufffd"
    assert detok.flush() == ""


def test_stream_decodes_a_small_window_per_token(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode(f"The capital is Seoul. {KOREAN} {EMOJI} " * 40)
    decoded_lengths: list[int] = []
    decode = tok.decode

    def counting_decode(token_ids, skip_special_tokens=True):
        decoded_lengths.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting_decode)
    _, streamed = stream(tok, ids, tok.apply_chat_template(QUESTION))
    monkeypatch.undo()
    assert streamed == tok.decode(ids)
    assert len(ids) > 1000
    assert max(decoded_lengths) <= 10  # work per token stays constant, whatever the output length


def test_load_hugging_face_directory(tok: Tokenizer, tmp_path) -> None:
    tok.hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    hf_dir = Tokenizer.load(tmp_path)
    assert hf_dir.eos_token_ids == {0, 2}
    assert hf_dir.chat_template == tok.chat_template
    text = f"Seoul ({KOREAN}) {EMOJI}"
    assert hf_dir.encode(text) == tok.encode(text)
    assert hf_dir.apply_chat_template(QUESTION) == tok.apply_chat_template(QUESTION)


def test_a_directory_without_a_chat_template_says_so_in_the_log(tok: Tokenizer, tmp_path, caplog) -> None:
    """The fallback where a tokenizer config has no chat template: named at load (ChatML: SmolLM2's vocabulary has
    its tokens; tests/test_chat_templates.py has the rest); text still works."""
    tok.hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="serval.tokenizer"):
        hf_dir = Tokenizer.load(tmp_path)
    assert hf_dir.chat_template == CHATML_TEMPLATE and hf_dir.chat_template_source == CHATML_FALLBACK
    assert f"{tmp_path}: the model's files carry no chat template; chats use the {CHATML_FALLBACK}" in caplog.text
    assert hf_dir.render_chat(QUESTION) == ("<|im_start|>user\nWhat is the capital city of Korea?<|im_end|>\n"
                                           "<|im_start|>assistant\n")
    assert hf_dir.encode("Seoul") == tok.encode("Seoul")


def test_runs_of_tokens_give_the_text_of_one_by_one_at_every_run_end(tok: Tokenizer) -> None:
    """add_tokens (a multi-step decode's run of tokens at once) gives, after every run, the text that add gives one
    token at a time, for runs of random lengths over text with multi-byte characters split across tokens, special
    tokens and a prompt's context; and the same final text."""
    import random

    text = f"Seoul ({KOREAN}) is lovely {EMOJI}\n\tnew line  two spaces. The end!"
    ids = tok.encode(text, add_special_tokens=False)
    ids = ids[:10] + [2] + ids[10:]  # <|im_end|>, skipped
    prompt = tok.encode("Tell me about Seoul:")
    rng = random.Random(0)
    for _ in range(40):
        one_by_one = IncrementalDetokenizer(tok, prompt)
        runs = IncrementalDetokenizer(tok, prompt)
        at = 0
        while at < len(ids):
            run = ids[at: at + rng.randint(1, 9)]
            at += len(run)
            for token_id in run:
                one_by_one.add(token_id)
            runs.add_tokens(run)
            assert runs.text == one_by_one.text and runs.token_ids == one_by_one.token_ids
        assert runs.text + runs.flush() == one_by_one.text + one_by_one.flush() == tok.decode(ids)
