"""The engine's front end: text in and out around an EngineCore that knows only token ids.

FrontEnd is the one front end, over either core client: LLMEngine's (an EngineCore in the same thread,
engine/engine.py) or CoreProcessClient's (a core process over ZeroMQ, engine/core_client.py). Its InputProcessor
tokenizes and validates a request and fans its n samples out into EngineCoreRequests; its OutputProcessor turns the
core's per-step token ids into RequestOutputs (incremental detokenizing, stop strings, logprobs, n samples gathered
back into one output).
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from serval.config import EngineConfig
from serval.engine.grammar_limits import check_grammar_size
from serval.engine.messages import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest
from serval.errors import CONTEXT_LENGTH_EXCEEDED, RequestError
from serval.model.model_files import check_model_files
from serval.model.registry import resolve_model_path
from serval.model.sampling_defaults import resolve_sampling_defaults
from serval.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from serval.sampling_params import SamplingParams, prompt_room
from serval.tokenizer import IncrementalDetokenizer, Tokenizer


class CoreClient(Protocol):
    """How a front end hands requests to its core: ``pack`` makes what crosses (checked: it may refuse a request
    with a ValueError before anything is registered; thread-safe), ``send`` hands it over."""

    def pack(self, core_requests: list[EngineCoreRequest]) -> Any: ...

    def send(self, packed: Any) -> None: ...


@dataclass
class PreparedRequest:
    """A request checked, tokenized and packed for its core, not registered yet."""

    request_id: str
    prompt_text: str | None
    core_requests: list[EngineCoreRequest]
    packed: Any  # what the core client sends


class FrontEnd:
    """The model's tokenizer and sampling defaults, and the one way a request goes in: ``prepare`` (checked,
    tokenized, one EngineCoreRequest per sample, packed by the core client; thread-safe, so a server runs it off its
    event loop), ``register`` (its outputs expected), then the core client's ``send``."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        """What the front end needs of the model before its core is up; ``connect`` once the core says what it is."""
        self.config = config
        self.model_path = resolve_model_path(config.model)
        # one line naming the file, before any load
        check_model_files(self.model_path, tokenizer=tokenizer is None, weights=config.load_format != "dummy")
        self.sampling_defaults = resolve_sampling_defaults(config.model, self.model_path, config.generation_config,
                                                           config.override_generation_config)
        self.tokenizer = tokenizer or Tokenizer.load(self.model_path)
        self.outputs = OutputProcessor(self.tokenizer)
        self.inputs: InputProcessor | None = None

    def connect(self, info: EngineCoreInfo) -> None:
        """The core is up: its context, vocabulary and token budget bound the requests from now on."""
        self.inputs = InputProcessor(self.config, self.tokenizer, info)

    def prepare(self, core: CoreClient, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                priority: int = 0, session_id: str | None = None, end_session: bool = False,
                tenant: str = "") -> PreparedRequest:
        """Raises RequestError (or another ValueError: a request the core client cannot pack) on bad input."""
        prompt_text, core_requests = self.inputs.process(request_id, prompt, params, priority, session_id,
                                                         end_session, tenant)
        return PreparedRequest(request_id, prompt_text, core_requests, core.pack(core_requests))

    def register(self, prepared: PreparedRequest) -> None:
        self.outputs.add(prepared.request_id, prepared.prompt_text, prepared.core_requests)


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, info: EngineCoreInfo) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.info = info  # its max_num_batched_tokens: settled by the core (the device's default)
        self.eos_token_ids = sorted(tokenizer.eos_token_ids)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                priority: int = 0, session_id: str | None = None,
                end_session: bool = False, tenant: str = "") -> tuple[str | None, list[EngineCoreRequest]]:
        """(the prompt's text, one core request per sample). Raises RequestError (a ValueError naming the field) on
        bad input SamplingParams could not check: the model's vocabulary and context, this engine's settings; the
        core trusts what passes. With n > 1 only the first sample continues the session: one answer is the
        conversation's next turn. Thread-safe; it tokenizes and checks a grammar, so a server calls it off its event
        loop."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params", f"sampling params must be a SamplingParams, got "
                               f"{type(params).__name__}")
        if not (isinstance(priority, int) and -(2**63) <= priority < 2**63):
            raise RequestError("priority", f"priority must be a 64-bit integer, got {priority!r}")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            outside = sorted(t for t in ids if t >= self.vocab_size)
            if outside:  # the sampler indexes the logits with them
                raise RequestError(name, f"{name}: token ids {outside} are not in the vocabulary [0, "
                                   f"{self.vocab_size})")
        prompt_text, prompt_ids = self._prompt_token_ids(prompt)
        max_tokens = self._resolve_max_tokens(len(prompt_ids), params)
        if params.min_tokens > max_tokens:  # max_tokens left out: the context's room bounds min_tokens too
            raise RequestError("min_tokens", f"min_tokens={params.min_tokens} is more than the {max_tokens} tokens "
                               "this request may generate")
        self._check_kv_transfer(params)
        if params.structured_outputs is not None:  # an oversized grammar is the caller's error (the core compiles)
            check_grammar_size(params.structured_outputs, self.config.structured_outputs)
        arrival = time.monotonic()
        requests = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child_params = params
            if params.n > 1 and (params.seed is not None or params.prompt_logprobs is not None):
                changes: dict = {"n": 1}
                if params.seed is not None:  # distinct but reproducible samples
                    changes["seed"] = params.seed + index
                if index > 0:  # the first sample scores the prompt; the others share its cached blocks
                    changes["prompt_logprobs"] = None
                child_params = SamplingParams(**{**params.__dict__, **changes})
            requests.append(EngineCoreRequest(child_id, prompt_ids, child_params, self.eos_token_ids, max_tokens,
                                              priority, request_id if params.n > 1 else None, arrival,
                                              session_id if index == 0 else None, not end_session, tenant))
        return prompt_text, requests

    def _check_kv_transfer(self, params: SamplingParams) -> None:
        """kv_transfer_params (engine/kv_transfer.py) that this worker's role cannot serve are the caller's error."""
        kv = params.kv_transfer_params
        if not kv:
            return
        role = self.config.kv_transfer.role
        if kv.get("do_remote_decode"):
            if role != "prefill":
                raise RequestError("kv_transfer_params", "kv_transfer_params.do_remote_decode needs a prefill worker "
                                   f"(serve --role prefill); this server's role is {role}")
        elif kv.get("do_remote_prefill"):
            if role != "decode":
                raise RequestError("kv_transfer_params", "kv_transfer_params.do_remote_prefill needs a decode worker "
                                   f"(serve --role decode); this server's role is {role}")
        else:
            raise RequestError("kv_transfer_params", "kv_transfer_params must say do_remote_decode or "
                               "do_remote_prefill")
        if params.n != 1:
            raise RequestError("kv_transfer_params", "kv_transfer_params needs n = 1 (one sample's KV moves)")
        transfer_id = kv.get("transfer_id")
        if transfer_id is not None and not (isinstance(transfer_id, str) and 0 < len(transfer_id) <= 256):
            raise RequestError("kv_transfer_params", "kv_transfer_params.transfer_id must be a string of 1 to 256 "
                               "characters")
        if kv.get("do_remote_prefill") and not (isinstance(transfer_id, str) and isinstance(kv.get("remote_address"),
                                                                                            str)):
            raise RequestError("kv_transfer_params", "kv_transfer_params.do_remote_prefill needs transfer_id and "
                               "remote_address: where the prefill worker holds the prompt's KV")

    def _prompt_token_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
            if not ids:  # a request of no tokens would wait for ever: the scheduler has nothing to run for it
                raise RequestError("prompt", "prompt is no tokens once tokenized: give text this model's tokenizer "
                                   "encodes")
            return prompt, ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise RequestError("prompt", "prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.vocab_size
        for token in prompt:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise RequestError("prompt", f"prompt token id {token!r} is not in the vocabulary [0, {vocab})")
        return None, list(prompt)

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        scheduler = self.config.scheduler
        if not scheduler.enable_chunked_prefill and num_prompt_tokens > self.info.max_num_batched_tokens:
            raise RequestError("prompt", f"prompt is {num_prompt_tokens} tokens, more than max_num_batched_tokens="
                               f"{self.info.max_num_batched_tokens}, and chunked prefill is off")
        # A prompt may fill the whole context only when nothing is generated after it (max_tokens 0).
        if num_prompt_tokens > prompt_room(limit, 0 if params.max_tokens == 0 else None):
            raise RequestError("prompt", f"prompt is {num_prompt_tokens} tokens; this model's context is {limit} "
                               "tokens", CONTEXT_LENGTH_EXCEEDED)
        if params.max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens > prompt_room(limit, params.max_tokens):
            raise RequestError("max_tokens", f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} "
                               f"tokens is more than this model's context of {limit} tokens", CONTEXT_LENGTH_EXCEEDED)
        return params.max_tokens


@functools.lru_cache(maxsize=1024)
def _stop_pattern(stops: tuple[str, ...]) -> re.Pattern:
    """One regular expression for a request's stop strings (compiled once per set): the leftmost match, the longest
    string at that place."""
    return re.compile("|".join(re.escape(stop) for stop in sorted(set(stops), key=len, reverse=True)))


@dataclass
class _Sample:
    """Output-side state of one sample (one core request)."""

    request_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict | None = None  # a prefill worker's: where a decode worker fetches this prompt's KV


@dataclass(eq=False)
class _Group:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # grows chunk by chunk; the first entry is None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self.samples: dict[str, tuple[_Group, _Sample]] = {}

    def add(self, request_id: str, prompt: str | None, core_requests: list[EngineCoreRequest]) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        first = core_requests[0]
        group = _Group(request_id, prompt, first.prompt_token_ids, [], arrival_time=first.arrival_time,
                       prompt_logprobs=[None] if first.params.prompt_logprobs is not None else None)
        for core_request in core_requests:
            params = core_request.params
            group.samples.append(_Sample(core_request.request_id, params,
                                         IncrementalDetokenizer(self.tokenizer, first.prompt_token_ids),
                                         logprobs=[] if params.logprobs is not None else None))
        self.groups[request_id] = group
        for sample in group.samples:
            self.samples[sample.request_id] = (group, sample)

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Ends a request here: (its final output with finish_reason "abort", the core requests still running).
        (None, []) for an unknown or finished id."""
        group = self.groups.get(request_id)
        if group is None:
            return None, []
        unfinished = [s.request_id for s in group.samples if s.finish_reason is None]
        for sample in group.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        return self._finish(group), unfinished

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(an output for every request that advanced or finished, the core requests that a stop string ended:
        the core must finish them too)."""
        touched: dict[str, _Group] = {}
        stopped: list[str] = []
        for out in core_outputs:
            entry = self.samples.get(out.request_id)
            if entry is None:
                continue  # aborted here while the core computed it
            group, sample = entry
            if sample.finish_reason is not None:
                continue
            touched[group.request_id] = group
            try:
                if self._process(group, sample, out):
                    stopped.append(sample.request_id)
            except Exception as exc:  # e.g. a detokenizer failure: only this request pays
                sample.finish_reason = "error"
                group.error = f"output processing failed: {exc}"
                stopped.append(sample.request_id)
        outputs = [self._finish(g) if g.finished else self._output(g) for g in touched.values()]
        return outputs, stopped

    def _process(self, group: _Group, sample: _Sample, out: EngineCoreOutput) -> bool:
        """Applies one core output to a sample; True when a stop string ended it here."""
        if out.first_scheduled_time is not None and group.first_scheduled_time is None:
            group.first_scheduled_time = out.first_scheduled_time
        sample.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            first, entries = out.prompt_logprobs
            del group.prompt_logprobs[first:]  # a chunk computed again after a preemption replaces its entries
            group.prompt_logprobs.extend(entries)
        if out.kv_transfer_params is not None:
            sample.kv_transfer_params = out.kv_transfer_params
        if out.error is not None:
            sample.finish_reason = "error"
            group.error = out.error
            return False
        if out.new_token_ids and group.first_token_time is None:
            group.first_token_time = time.monotonic()
        previous_len, num_tokens = len(sample.text), len(sample.token_ids)
        num_logprobs = len(sample.logprobs) if sample.logprobs is not None else 0
        stops = sample.params.stop
        # A run of tokens (multi-step decoding, accepted guesses) that a stop string may end inside: the state to
        # find, one token at a time, the token that completed it.
        before = sample.detokenizer.copy() if stops and len(out.new_token_ids) > 1 else None
        if out.new_token_ids:
            sample.token_ids.extend(out.new_token_ids)
            sample.text += sample.detokenizer.add_tokens(out.new_token_ids)
        if sample.logprobs is not None and out.new_logprobs:
            sample.logprobs.extend(out.new_logprobs)
        if stops and out.new_token_ids:
            # One pass over the new text (and the tail a stop string could begin in) for all the stop strings at
            # once: the earliest one found ends the sample.
            window_start = max(0, previous_len - max(map(len, stops)) + 1)
            found = _stop_pattern(tuple(stops)).search(sample.text, window_start)
            if found is not None:
                at, stop = found.start(), found.group()
                if before is not None:  # the output ends with that token, as one token a step would end it
                    kept = num_tokens + _tokens_to_reach(before, out.new_token_ids, at + len(stop) - previous_len)
                    del sample.token_ids[kept:]
                    if sample.logprobs is not None:
                        del sample.logprobs[num_logprobs + kept - num_tokens:]
                keep = at + len(stop) if sample.params.include_stop_str_in_output else at
                sample.text = sample.text[:keep]
                sample.finish_reason, sample.stop_reason = "stop", stop
                return out.finish_reason is None
        if out.finish_reason is not None:
            sample.text += sample.detokenizer.flush()  # bytes of a character the output cut in half
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _finish(self, group: _Group) -> RequestOutput:
        for sample in group.samples:
            self.samples.pop(sample.request_id, None)
        self.groups.pop(group.request_id, None)
        return self._output(group)

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for index, sample in enumerate(group.samples):
            text = sample.text
            stops = sample.params.stop
            if sample.finish_reason is None and stops:  # hold back a possible stop string's beginning
                text = text[: max(0, len(text) - max(map(len, stops)) + 1)]
            completions.append(CompletionOutput(index, text, list(sample.token_ids), sample.finish_reason,
                                                sample.stop_reason,
                                                list(sample.logprobs) if sample.logprobs is not None else None))
        metrics = {"arrival_time": group.arrival_time, "now": time.monotonic()}
        if group.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = group.first_scheduled_time
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        prompt_logprobs = list(group.prompt_logprobs) if group.prompt_logprobs is not None else None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             group.samples[0].num_cached_tokens, group.finished, group.error, metrics,
                             prompt_logprobs, group.samples[0].kv_transfer_params)


def _tokens_to_reach(detokenizer: IncrementalDetokenizer, token_ids: list[int], length: int) -> int:
    """How many of ``token_ids``, added one at a time to ``detokenizer``, it takes for their text to be ``length``
    characters long (all of them if it never is)."""
    text = ""
    for count, token_id in enumerate(token_ids, 1):
        text += detokenizer.add(token_id)
        if len(text) >= length:
            return count
    return len(token_ids)
