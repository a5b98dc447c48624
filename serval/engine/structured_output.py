"""Structured outputs: grammars that constrain a request's tokens, enforced with xgrammar's token bitmasks.

xgrammar was measured against llguidance on this tokenizer (benchmarks/README.md): compile 4-5 ms per schema
against 1.2-1.4 ms, but a mask per token in 19 us (p50) against 343 us, and masks are paid every step.

A grammar is compiled once, in the core, on a compile thread: the front end only checks its size against
StructuredOutputConfig and parses it (milliseconds, no token masks), so a bad schema or regex is refused before the
request is queued; the core keeps the request out of the scheduler until its grammar is compiled, and steps the
other requests meanwhile. A compiled grammar cannot cross to the core's process instead: serialized, 1,000
optional JSON properties took 356 MB. The core keeps one matcher per request, advanced by every token the request
keeps. Each step it fills one bitmask row per position the request samples (several when it checks guesses); the
sampler applies the whole batch's mask at once.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from serval.config import StructuredOutputConfig
from serval.sampling_params import StructuredOutputsParams
from serval.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# JSON from a schema is written compactly: with free whitespace a small model can loop on newlines forever.
JSON_SEPARATORS = (", ", ": ")
COMPILE_THREADS = 2  # a slow grammar (up to the time limit) leaves one thread for the others
# The compile threads' nice value: on a busy CPU the step loop comes first (xgrammar's own workers, started by a
# compile, inherit it).
COMPILE_NICENESS = 10


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """What xgrammar needs of the tokenizer (every token's bytes), for the model's vocabulary size (the embedding
    may have more rows than the tokenizer has tokens)."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer.hf_tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=sorted(tokenizer.eos_token_ids))


class GrammarCompiler:
    def __init__(self, info: xgr.TokenizerInfo) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)

    @classmethod
    def from_json(cls, info_json: str) -> GrammarCompiler:
        """A compiler for the TokenizerInfo a front end serialized (the core process has no tokenizer)."""
        return cls(xgr.TokenizerInfo.deserialize_json(info_json))

    def to_json(self) -> str:
        return self.info.serialize_json()

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Raises ValueError naming what is wrong with the schema, regex or grammar."""
        try:
            if spec.json is not None:
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)  # keeps property order
                return self._compiler.compile_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS,
                                                          strict_mode=True)
            if spec.json_object:  # any JSON object (OpenAI's json_object mode); strict would allow only {}
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                          separators=JSON_SEPARATORS, strict_mode=False)
            if spec.regex is not None:
                return self._compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
                return self._compiler.compile_grammar(f"root ::= {alternatives}")
            return self._compiler.compile_grammar(spec.grammar)
        except RuntimeError as exc:  # xgrammar's C++ errors: keep the message, drop its source location
            raise ValueError(f"invalid structured output {spec_kind(spec)}: {_clean(str(exc))}") from None


def spec_kind(spec: StructuredOutputsParams) -> str:
    return next(name for name in ("json", "json_object", "regex", "choice", "grammar")
                if getattr(spec, name) not in (None, False))


def check_grammar(spec: StructuredOutputsParams, limits: StructuredOutputConfig) -> None:
    """Refuses a grammar past the size limits, or one that does not parse (ValueError naming what is wrong). Cheap:
    sizes and a parse, no token masks (the core compiles the grammar)."""
    kind = spec_kind(spec)

    def refuse(what: str) -> ValueError:
        return ValueError(f"invalid structured output {kind}: {what}")

    try:
        if spec.json is not None:
            text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            if len(text.encode("utf-8", "surrogatepass")) > limits.max_schema_bytes:
                raise refuse(f"the schema is {len(text)} characters; the limit is {limits.max_schema_bytes} bytes")
            try:
                schema = json.loads(text) if isinstance(spec.json, str) else spec.json
            except (ValueError, RecursionError):
                schema = None  # xgrammar's parse below says what is wrong
            members = _schema_members(schema)
            if members > limits.max_schema_members:
                raise refuse(f"the schema has {members} properties, enum values and anyOf/oneOf/allOf branches; "
                             f"the limit is {limits.max_schema_members}")
            xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True)
        elif spec.regex is not None:
            if len(spec.regex) > limits.max_regex_chars:
                raise refuse(f"the regex is {len(spec.regex)} characters; the limit is {limits.max_regex_chars}")
            xgr.Grammar.from_regex(spec.regex)
        elif spec.choice is not None:
            if len(spec.choice) > limits.max_choices:
                raise refuse(f"{len(spec.choice)} choices; the limit is {limits.max_choices}")
            chars = sum(map(len, spec.choice))
            if chars > limits.max_choice_chars:
                raise refuse(f"the choices are {chars} characters together; the limit is {limits.max_choice_chars}")
        elif spec.grammar is not None:
            if len(spec.grammar) > limits.max_grammar_chars:
                raise refuse(f"the grammar is {len(spec.grammar)} characters; the limit is "
                             f"{limits.max_grammar_chars}")
            xgr.Grammar.from_ebnf(spec.grammar)
    except RuntimeError as exc:
        raise refuse(_clean(str(exc))) from None


def _schema_members(schema) -> int:
    """Properties, enum values and anyOf/oneOf/allOf branches in the whole schema (what its grammar grows with)."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("properties", "enum", "anyOf", "oneOf", "allOf"):
                if isinstance(node.get(key), (dict, list)):
                    count += len(node[key])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def json_schema_ebnf(schema: dict) -> str:
    """The EBNF rules (root: ``root``) of JSON that follows ``schema``, written as the compiler writes it."""
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=JSON_SEPARATORS, strict_mode=True))
    except RuntimeError as exc:
        raise ValueError(f"invalid JSON schema: {_clean(str(exc))}") from None


def with_root(rules: str, root_rule: str) -> str:
    """``rules`` re-written with ``root_rule`` as the root (the old ``root`` is renamed, references and all)."""
    try:
        return str(xgr.Grammar.from_ebnf(rules, root_rule_name=root_rule))
    except RuntimeError as exc:
        raise ValueError(f"invalid grammar: {_clean(str(exc))}") from None


def _clean(message: str) -> str:
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message.strip())
    return message.replace("Check failed: (error.empty()) is false: ", "").strip()


@dataclass(eq=False)
class _Compile:
    """One request's grammar on its way through a compile thread."""

    request_id: str
    spec: StructuredOutputsParams
    future: Future = field(default_factory=Future)
    started: float | None = None  # when a compile thread took it


class StructuredOutputManager:
    """The core's matchers, one per constrained request, and the bitmasks they give each step. Grammars compile on
    compile threads (xgrammar releases the GIL), never on the step loop: submit(), then take_compiled() each step."""

    def __init__(self, compiler: GrammarCompiler, compile_timeout_s: float = StructuredOutputConfig.compile_timeout_s
                 ) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._compiling: dict[str, _Compile] = {}
        self._jobs: queue.SimpleQueue[_Compile] = queue.SimpleQueue()
        # Daemon threads: a compile cannot be interrupted, and one must never keep the process from exiting.
        for index in range(COMPILE_THREADS):
            threading.Thread(target=self._compile_jobs, name=f"serval-grammar-{index}", daemon=True).start()

    def _compile_jobs(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)  # this thread only (Linux)
        except (AttributeError, OSError):  # elsewhere it stays at the process's priority
            pass
        while True:
            job = self._jobs.get()
            if not job.future.set_running_or_notify_cancel():
                continue  # its request ended while it waited
            job.started = time.monotonic()
            try:
                job.future.set_result(xgr.GrammarMatcher(self.compiler.compile(job.spec)))
            except BaseException as exc:  # noqa: BLE001 - the request's error, read by take_compiled
                job.future.set_exception(exc)

    def submit(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Starts compiling a request's grammar; take_compiled() says when its matcher is ready."""
        job = self._compiling[request_id] = _Compile(request_id, spec)
        self._jobs.put(job)

    def take_compiled(self) -> tuple[list[str], dict[str, str]]:
        """(the requests whose grammar is now ready, the errors of those whose grammar failed to compile or ran
        past the time limit)."""
        ready, failed = [], {}
        now = time.monotonic()
        for request_id, job in list(self._compiling.items()):
            if job.future.done():
                del self._compiling[request_id]
                try:
                    self._matchers[request_id] = job.future.result()
                    ready.append(request_id)
                except Exception as exc:  # noqa: BLE001 - a compile error is this request's alone
                    failed[request_id] = str(exc) if isinstance(exc, ValueError) else f"grammar compile failed: {exc}"
            elif job.started is not None and now - job.started > self.compile_timeout_s:
                del self._compiling[request_id]  # its thread runs on to the end; the result is dropped
                logger.warning("request %s: its grammar took longer than %.0f s to compile; failed", request_id,
                               self.compile_timeout_s)
                failed[request_id] = (f"invalid structured output {spec_kind(job.spec)}: the grammar took longer "
                                      f"than {self.compile_timeout_s:g} s to compile (the server's limit); "
                                      "simplify it")
        return ready, failed

    def wait_compiled(self, timeout: float) -> None:
        """Blocks until a compile ends or ``timeout`` seconds pass (when nothing else is there to run)."""
        futures = [job.future for job in self._compiling.values()]
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        job = self._compiling.pop(request_id, None)
        if job is not None:
            job.future.cancel()  # a compile not yet started is skipped

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def valid_prefix(self, request_id: str, guesses: list[int]) -> list[int]:
        """The leading guesses the grammar allows: guesses it refuses could never be accepted."""
        matcher = self._matchers[request_id]
        kept = 0
        while kept < len(guesses) and not matcher.is_terminated() and matcher.accept_token(guesses[kept]):
            kept += 1
        matcher.rollback(kept)
        return guesses[:kept]

    def bitmasks(self, wanted: dict[str, list[int]]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """For each request id -> its guesses (already valid): the allowed tokens at its next position and after
        each guess, as an int32 ``[1 + len(guesses), ceil(vocab / 32)]`` bitmask (bit i of word w: token 32w+i).
        Rows after a guess that ends the grammar (its stop token) allow everything: the request ends there.
        Also returns the errors of requests whose matcher failed, which fail alone."""
        masks, errors = {}, {}
        for request_id, guesses in wanted.items():
            matcher = self._matchers[request_id]
            mask = xgr.allocate_token_bitmask(len(guesses) + 1, self.vocab_size)
            accepted = 0
            try:
                for row in range(len(guesses) + 1):
                    if matcher.is_terminated():
                        break
                    matcher.fill_next_token_bitmask(mask, row)
                    if row < len(guesses):
                        matcher.accept_token(guesses[row])
                        accepted += 1
            except RuntimeError as exc:
                errors[request_id] = f"grammar matcher failed: {_clean(str(exc))}"
            matcher.rollback(accepted)
            masks[request_id] = mask
        return masks, errors

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advances the request's matcher over the tokens it kept; False if the grammar refuses one (a token the
        mask did not allow: only when every token was masked)."""
        matcher = self._matchers[request_id]
        return all(matcher.accept_token(token) for token in token_ids)

    def is_terminated(self, request_id: str) -> bool:
        """The grammar is complete and its stop token was taken: nothing may follow."""
        return self._matchers[request_id].is_terminated()
