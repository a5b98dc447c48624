"""Text ↔ token ids for a model: encoding, chat templates and streaming (incremental) detokenization."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serval.config import cache_directory
from serval.errors import ModelFileError, RequestError

if TYPE_CHECKING:
    from serval.gguf_reader import GGUFContents

logger = logging.getLogger(__name__)

# Gemma's chat format, for Gemma 2 and 3 GGUF files that carry no template: turns of <start_of_turn>{user|model}\n ...
# <end_of_turn>\n after <bos>, a system message prefixed to the first user turn, and roles that alternate.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# The fallbacks for any other model whose files carry no chat template (named in the log and in /v1/models): ChatML
# where the vocabulary has its two special tokens (the model likely saw it in training, as Qwen's base models did),
# else one "role: content" line per message, after BOS, ending in "assistant:".
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
CHATML_FALLBACK = "fallback: ChatML (<|im_start|>role ... <|im_end|>)"
PLAIN_FALLBACK = "fallback: plain 'role: content' lines"
# Special tokens that end a turn, which llama.cpp stops at in any GGUF file whose vocabulary has them (llama-vocab.cpp's
# end-of-generation set): a file's header often names only the end of the text as its eos (Phi-3's <|endoftext|>, not
# its <|end|>).
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
                      "<｜end▁of▁sentence｜>")
# Where a Hugging Face directory's chat template lives: transformers 5 writes chat_template.jinja (and reads it
# itself); processors wrote chat_template.json ({"chat_template": ...}); older tokenizers keep it in
# tokenizer_config.json.
CHAT_TEMPLATE_JSON = "chat_template.json"
# A Hugging Face directory's tokenizer is any of these: without them transformers builds an empty tokenizer (every
# text is zero ids), or none.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
EXPECTED_TOKENIZER_FILES = "tokenizer.json, tokenizer.model, or vocab.json with merges.txt"


def has_tokenizer_files(directory: Path) -> bool:
    """Whether ``directory`` holds one of TOKENIZER_FILES."""
    return any(all((directory / name).is_file() for name in files) for files in TOKENIZER_FILES)


class Tokenizer:
    """A model's tokenizer, loaded from a GGUF file or a Hugging Face directory, always offline.

    Encoding and decoding go straight to the Rust ``tokenizers`` backend (fast, no Python-side
    clean-up), so :meth:`decode` and :class:`IncrementalDetokenizer` agree on the text.
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: set[int] | None = None,
                 chat_template_source: str | None = None) -> None:
        self.hf_tokenizer = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        # len() counts added tokens too, so every id the tokenizer can produce is < vocab_size.
        self.vocab_size: int = len(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        ids = set(eos_token_ids or ())
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        self.eos_token_ids: set[int] = ids
        self.chat_template: str | dict | None = hf_tokenizer.chat_template or None
        # Where the chat template came from, or which fallback stands in for it (the log, /v1/models).
        self.chat_template_source: str = chat_template_source or ("the tokenizer" if self.chat_template else "none")

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load from a ``.gguf`` file (tokenizer built from its metadata) or a Hugging Face model directory, with the
        model's own chat template and end-of-sequence ids; a model without a template gets a fallback (a warning
        names it). Raises ModelFileError (one line naming the files expected) for a model without a usable
        tokenizer: a directory without tokenizer files, files it cannot be built from, an empty vocabulary."""
        path = Path(path).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            from serval.gguf_reader import GGUFContents  # numpy: imported here, after `serve` has started the core

            header = GGUFContents(path)
            hf = _load_gguf_tokenizer(path, header)
            # llama.cpp's end-of-generation set: eos, end-of-turn and end-of-message from the header, and the
            # turn-ending special tokens of the vocabulary.
            keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            eos_ids = {int(header.value(k)) for k in keys if isinstance(header.value(k), int)} | _end_of_turn_ids(hf)
            source = "tokenizer.chat_template in the GGUF header"
            if not hf.chat_template and header.value("general.architecture") in ("gemma2", "gemma3"):
                hf.chat_template, source = GEMMA_CHAT_TEMPLATE, "Serval's Gemma template (the GGUF header has none)"
        elif path.is_dir():
            if not has_tokenizer_files(path):
                raise ModelFileError(f"{path}: no tokenizer: expected {EXPECTED_TOKENIZER_FILES}")
            try:
                hf = _load_hf_tokenizer(path)
            except Exception as exc:  # a damaged or partial file: its first line, not a traceback
                first_line = (str(exc).strip().splitlines() or [""])[0]
                raise ModelFileError(f"{path}: its tokenizer cannot be built from its files ({type(exc).__name__}: "
                                     f"{first_line})") from exc
            eos_ids = _hf_dir_eos_ids(path)
            source = _hf_dir_chat_template(path, hf)
        else:
            raise FileNotFoundError(f"tokenizer path {str(path)!r} is neither a .gguf file nor a directory")
        if hf.backend_tokenizer.get_vocab_size(with_added_tokens=False) == 0 or not hf.backend_tokenizer.encode(
                "a", add_special_tokens=False).ids:  # every prompt would be zero ids, which nothing can run
            raise ModelFileError(f"{path}: no usable tokenizer: its vocabulary is empty (expected "
                                 f"{EXPECTED_TOKENIZER_FILES if path.is_dir() else 'tokenizer.ggml.tokens'})")
        if not hf.chat_template:
            hf.chat_template, source, extra_eos = _fallback_chat_template(hf)
            eos_ids |= extra_eos
            logger.warning("%s: the model's files carry no chat template; chats use the %s", path, source)
        return cls(hf, eos_ids, source)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the model's post-processor adds (e.g. BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; incomplete UTF-8 sequences come out as U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def chat_template_renders_tools(self) -> bool:
        """Whether the chat template takes a ``tools`` list (else tools are written into the prompt by hand)."""
        templates = self.chat_template if isinstance(self.chat_template, dict) else {"": self.chat_template or ""}
        return any("tools" in template for template in templates.values())

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat rendered to text by the model's chat template (special tokens as text); ``tools`` go to a
        template that renders them."""
        if not self.chat_template:
            raise RequestError("messages", "this model has no chat template; send a plain prompt instead of chat "
                               "messages")
        _check_messages(messages)
        from jinja2 import TemplateError

        try:
            return self.hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except TemplateError as e:  # e.g. the template's own raise_exception("roles must alternate ...")
            raise RequestError("messages", f"chat template rejected the messages: {e}") from e

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat, ready to be a prompt.

        Raises RequestError (``messages``) if the model has no chat template or a message is malformed.
        """
        # The template writes special tokens (BOS, <|im_start|>) itself, so add none here.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never emitting broken UTF-8.

    The prefix/read-offset method: decode a small window (a few tokens of already-emitted context plus the
    new ones) and emit what goes beyond the context's text. A window whose text ends in U+FFFD is a
    multi-byte character split across tokens; it is held back until the character completes. The
    context makes leading spaces and the first token after the prompt decode as they do in a full decode,
    so the deltas join to ``tokenizer.decode(token_ids)`` in the usual case; call :meth:`flush` at the end
    to get text still held back (an output that ends mid-character).
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text: str = ""
        # _window holds ids from the prefix offset on; _read is where the not-yet-emitted ids start in it.
        self._window: list[int] = list(prompt_token_ids[-self._CONTEXT_TOKENS :])
        self._read = len(self._window)
        self._prefix_text: str | None = None  # decode(_window[:_read]), cached while text is held back

    def add(self, token_id: int) -> str:
        """Append one output token; return the new text ('' while a character is incomplete)."""
        self.token_ids.append(token_id)
        self._window.append(token_id)
        prefix_text = self._prefix()
        new_text = self._decode(self._window)
        if new_text.endswith("\ufffd") or len(new_text) < len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append several output tokens (a step's run of them); return the text ``add`` gives them one by one, from
        one decode of the window instead of two per token. A run whose text ends in a split character goes one by
        one, so that what comes out before that character is not held back with it."""
        if len(token_ids) == 1:
            return self.add(token_ids[0])
        prefix_text = self._prefix()
        window = self._window + list(token_ids)
        new_text = self._decode(window)
        if new_text.endswith("\ufffd") or len(new_text) < len(prefix_text):
            return "".join(self.add(token_id) for token_id in token_ids)
        self.token_ids.extend(token_ids)
        self._window = window
        return self._emit(new_text[len(prefix_text):])

    def copy(self) -> IncrementalDetokenizer:
        """A detokenizer in this one's state that goes on apart from it."""
        other = copy.copy(self)
        other.token_ids, other._window = list(self.token_ids), list(self._window)
        return other

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character comes out as U+FFFD); call once at the end."""
        if self._read == len(self._window):
            return ""
        prefix_text = self._prefix()
        return self._emit(self._decode(self._window)[len(prefix_text) :])

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        return self._prefix_text

    def _emit(self, delta: str) -> str:
        # The just-emitted ids become the context of the next window; older ones are dropped.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = None
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError("messages", f"messages[{i}] must be an object with 'role' and 'content', got "
                               f"{type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise RequestError("messages", f"messages[{i}] is missing {key!r}")
            if not isinstance(m[key], str):
                raise RequestError("messages", f"messages[{i}].{key} must be a string, got {type(m[key]).__name__}")


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _load_hf_tokenizer(directory: Path, gguf_file: str | None = None, as_saved: bool = False) -> Any:
    """The tokenizer of a directory (or of a GGUF file in it). The class its tokenizer_config.json names is built
    directly, as AutoTokenizer would build it: AutoTokenizer imports transformers' model configs, which import
    torch, and a server's process has no torch (tests/test_architecture.py). ``as_saved``: its tokenizer.json read
    as it is, by the generic fast tokenizer (a converted GGUF tokenizer in the cache: the class its config names,
    Qwen2Tokenizer or GemmaTokenizer, would rebuild the pre-tokenizer and merges by its own rules, not the
    file's)."""
    import transformers

    kwargs: dict[str, Any] = {"local_files_only": True}
    tokenizer_class = None
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    elif as_saved:
        tokenizer_class = transformers.PreTrainedTokenizerFast
    else:
        config_file = directory / "tokenizer_config.json"
        name = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
        tokenizer_class = getattr(transformers, name, None) if isinstance(name, str) else None
    with _quiet_transformers():
        if tokenizer_class is None:
            hf = transformers.AutoTokenizer.from_pretrained(str(directory), **kwargs)
        else:
            hf = tokenizer_class.from_pretrained(str(directory), **kwargs)
    if getattr(hf, "backend_tokenizer", None) is None:
        raise ValueError(f"no fast (tokenizers) tokenizer could be built for {str(directory)!r}")
    return hf


def _load_gguf_tokenizer(path: Path, header: GGUFContents) -> Any:
    """The tokenizer transformers builds from a GGUF file's header, converted once and kept in the cache folder.

    The conversion takes seconds on every load (8 s for SmolLM2's 49k-token vocabulary, 20 s for Gemma 3's 262k on
    2 cores); reading the saved tokenizer back takes a fraction of that. The cache entry is named by a digest of the
    header's key/value bytes and the transformers and tokenizers versions: a file with other metadata or another
    library converts again, and the same metadata (a copy of a file, a test's model written again) shares one
    entry. It is written under a temporary name and renamed, so a reader never sees half of one.

    The conversion runs in a child process (transformers' GGUF reader imports torch, which a server's process never
    does) that writes the entry; where the cache folder cannot be written, it writes to a temporary folder, read
    once and removed, each time."""
    import tokenizers
    import transformers

    identity = f"{header.metadata_digest()}|{transformers.__version__}|{tokenizers.__version__}"
    entry = cache_directory() / "tokenizers" / hashlib.sha256(identity.encode()).hexdigest()[:16]
    if (entry / "tokenizer.json").is_file():
        return _load_hf_tokenizer(entry, as_saved=True)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{entry.name}.partial-", dir=entry.parent))
    except OSError as exc:
        logger.info("%s: the converted tokenizer is not cached (%s)", path.name, exc)
        partial = Path(tempfile.mkdtemp(prefix="serval-tokenizer-"))
    try:
        _convert_in_a_child(path, partial)
        try:
            partial.replace(entry)
            return _load_hf_tokenizer(entry, as_saved=True)
        except OSError:  # unwritable, or another process renamed its copy there first
            return _load_hf_tokenizer(entry if (entry / "tokenizer.json").is_file() else partial, as_saved=True)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _convert_in_a_child(path: Path, out: Path) -> None:
    """Converts the GGUF file's tokenizer and saves it in ``out``, in a fresh interpreter of this very serval."""
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    code = ("import sys; from pathlib import Path; from serval.tokenizer import _load_hf_tokenizer; "
            "path = Path(sys.argv[1]); "
            "_load_hf_tokenizer(path.parent, gguf_file=path.name).save_pretrained(sys.argv[2])")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(out)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"{path.name}: its tokenizer could not be converted: {done.stderr.strip()[-2000:]}")


def _hf_dir_chat_template(directory: Path, hf: Any) -> str:
    """Where ``hf``'s chat template came from (the file's name), after reading chat_template.json into it, which
    transformers' tokenizers leave unread; "none" without a template."""
    if (directory / "chat_template.jinja").is_file():
        return "chat_template.jinja"
    if hf.chat_template:
        return "tokenizer_config.json"
    file = directory / CHAT_TEMPLATE_JSON
    if file.is_file():
        template = json.loads(file.read_text()).get("chat_template")
        if template:
            hf.chat_template = template
            return CHAT_TEMPLATE_JSON
    return "none"


def _fallback_chat_template(hf: Any) -> tuple[str, str, set[int]]:
    """(template, its name, the end-of-turn ids it adds) for a tokenizer without a chat template."""
    specials = _special_token_ids(hf)
    if "<|im_start|>" in specials and "<|im_end|>" in specials:
        return CHATML_TEMPLATE, CHATML_FALLBACK, {specials["<|im_end|>"]}
    return PLAIN_CHAT_TEMPLATE, PLAIN_FALLBACK, set()


def _special_token_ids(hf: Any) -> dict[str, int]:
    return {token.content: token_id for token_id, token in hf.added_tokens_decoder.items() if token.special}


def _end_of_turn_ids(hf: Any) -> set[int]:
    specials = _special_token_ids(hf)
    return {specials[text] for text in END_OF_TURN_TOKENS if text in specials}


def _hf_dir_eos_ids(directory: Path) -> set[int]:
    """End-of-sequence ids from generation_config.json and config.json (an int or a list in either)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int):
                ids.add(v)
    return ids


