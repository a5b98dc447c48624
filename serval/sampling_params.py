"""Per-request sampling settings, with the OpenAI / vLLM names, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from serval.errors import RequestError

# The fields a model may bring its own defaults for (generation_config.json, GGUF general.sampling.*), as vLLM
# reads them; a request's explicit value wins over the model's, the model's over SamplingParams' (OpenAI's).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# EngineConfig.generation_config's default (here, where the light CLI reads it too): the model's own defaults.
GENERATION_CONFIG_DEFAULT = "auto"


@dataclass
class ToolCallsGrammar:
    """Tool calls as a grammar (a required tool choice, or a named function): one block between ``start`` and
    ``end`` holding a JSON call ``{"name": ..., "arguments": ...}`` of one of ``functions`` (each ``{"name": ...,
    "parameters": <its JSON schema>}``), whose arguments follow its schema; several blocks, one a line, when
    ``repeat``. The engine writes the grammar (the server's process has no grammar library)."""

    functions: list[dict]
    start: str
    end: str
    repeat: bool = False


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow: exactly one of the fields (vLLM's names, and tool_calls).

    ``json``: a JSON schema (dict or JSON text); ``json_object``: any JSON object; ``regex``; ``choice``: one of
    these strings; ``grammar``: an EBNF grammar with a ``root`` rule; ``tool_calls``: a chat's tool calls. Compiled
    and enforced by the engine core (engine/structured_output.py); compile errors are RequestErrors
    (errors.grammar_error).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    tool_calls: ToolCallsGrammar | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tool_calls, dict):
            self.tool_calls = ToolCallsGrammar(**self.tool_calls)
        given = [name for name in ("json", "regex", "choice", "grammar", "tool_calls")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        _check(len(given) == 1, "structured_outputs",
               f"must set exactly one of json, json_object, regex, choice, grammar, tool_calls; got {given or 'none'}")
        _check(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs.json",
               "must be a JSON schema (an object, or its JSON text)")
        _check(self.regex is None or isinstance(self.regex, str), "structured_outputs.regex", "must be a string")
        _check(self.grammar is None or isinstance(self.grammar, str), "structured_outputs.grammar",
               "must be a string")
        _check(self.tool_calls is None or isinstance(self.tool_calls, ToolCallsGrammar),
               "structured_outputs.tool_calls", "must be a ToolCallsGrammar")
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice), "structured_outputs.choice",
                   "must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """The field that is set: what an error about this grammar names."""
        return next(name for name in ("json", "json_object", "regex", "choice", "grammar", "tool_calls")
                    if getattr(self, name) not in (None, False))


# max_tokens when a request leaves it out: vLLM's SamplingParams default and OpenAI's documented one for
# /v1/completions. (Chat leaves it None: up to the context, what OpenAI's chat API does.)
DEFAULT_MAX_TOKENS = 16
# Stop strings are matched against every new piece of text: a bound on them bounds that work (OpenAI allows 4, vLLM
# sets none).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 2048  # their lengths added up


def prompt_room(max_model_len: int, max_tokens: int | None) -> int:
    """How many prompt tokens fit in a context of ``max_model_len`` beside ``max_tokens`` generated ones: with
    ``max_tokens`` None (up to the context) room for at least one; with 0 (the prompt only) the whole context.
    At most 0: none."""
    return max_model_len - (1 if max_tokens is None else max_tokens)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. Stop strings are cut from the returned text. ``max_tokens=0`` with
    ``prompt_logprobs`` scores a prompt without generating (what evaluation harnesses ask for); a request with
    ``prompt_logprobs`` computes its whole prompt, never taking prefix-cache hits (they keep no logits).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to the logits
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: up to the context window; 0: the prompt only (to score it)
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (0: only the prompt's own token)
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a grammar
    # Disaggregated prefill/decode (engine/kv_transfer.py): {"do_remote_decode": true} asks a prefill worker to keep
    # the prompt's KV for a decode worker; the params its response carries, with "do_remote_prefill": true, tell the
    # decode worker where to fetch it.
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # given as its fields (JSON)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty!r}")
        _check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty!r}")
        _check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must be a dict of token id -> bias")
            for token_id, bias in self.logit_bias.items():
                _check(isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0, "logit_bias",
                       f"keys must be token ids (integers >= 0), got {token_id!r}")
                _check(_is_number(bias) and -100 <= bias <= 100, "logit_bias",
                       f"values must be in [-100, 100], got {bias!r} for token {token_id}")
        _check(self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict), "kv_transfer_params",
               "must be an object")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        _check(sum(map(len, self.stop)) <= MAX_STOP_CHARS, "stop",
               f"takes at most {MAX_STOP_CHARS} characters in all, got {sum(map(len, self.stop))}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"must be >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0), "max_tokens",
               f"must be >= 0, got {self.max_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
               f"must be in [0, 20], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and
                                                 0 <= self.prompt_logprobs <= 20),
               "prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_sampling_defaults(values: dict, where: str) -> dict[str, float | int]:
    """``values`` as a model's sampling defaults: only MODEL_DEFAULT_FIELDS, numbers of the right kind (top_k an
    integer) in SamplingParams' ranges. ValueError naming ``where`` (a file, a flag) otherwise."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be an object of {', '.join(MODEL_DEFAULT_FIELDS)}, got {values!r}")
    unknown = sorted(set(values) - set(MODEL_DEFAULT_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; known: {', '.join(MODEL_DEFAULT_FIELDS)}")
    out: dict[str, float | int] = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {name} must be a number, got {value!r}")
        if name == "top_k":
            if value != int(value):
                raise ValueError(f"{where}: top_k must be an integer, got {value!r}")
            out[name] = int(value)
        else:
            out[name] = float(value)
    try:
        SamplingParams(**out)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return out


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise RequestError(name, f"SamplingParams.{name} {message}")


def takes_argmax_only(params: SamplingParams) -> bool:
    """Whether a row of ``params`` is sampled by its logits' argmax and nothing else: greedy, with no logprobs, logit
    bias or penalty (its blocked ids are the caller's to rule out: ``greedy_tokens`` takes none)."""
    return params.greedy and params.logprobs is None and not params.logit_bias and samples_without_the_host(params)


def samples_without_the_host(params: SamplingParams) -> bool:
    """Whether a row of ``params`` draws its token from its logits alone (and its seed at its position), so that a
    run of forwards can feed each token to the next forward on the device: no penalty over the output so far (its
    blocked ids are the caller's to rule out; its logprobs, if asked for, come from the same logits)."""
    return params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
