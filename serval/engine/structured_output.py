"""Structured outputs: grammars that constrain a request's tokens, enforced with xgrammar's token bitmasks.

xgrammar was measured against llguidance on this tokenizer (benchmarks/README.md): compile 4-5 ms per schema
against 1.2-1.4 ms, but a mask per token in 19 us (p50) against 343 us, and masks are paid every step.

A grammar is parsed and compiled here, in the core, on a compile thread: the front end only checks its size
(grammar_limits.py; the server's process imports no xgrammar, which imports torch), so an oversized grammar is
refused before the request is queued and one that does not compile fails alone (the server answers 400 naming its
field either way). The core keeps the request out of the scheduler until its grammar is compiled, and steps the
other requests meanwhile. The compiler's tokenizer table is built here from the model's own tokenizer, on a compile
thread too. The core keeps one matcher per request, advanced by every token the request keeps. Each step it fills
one bitmask row per position the request samples (several when it checks guesses); the sampler applies the whole
batch's mask at once.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from serval.config import StructuredOutputConfig
from serval.errors import grammar_error
from serval.sampling_params import StructuredOutputsParams, ToolCallsGrammar
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
    def for_model(cls, model_path: str, vocab_size: int) -> GrammarCompiler:
        """A compiler for the model's own tokenizer (about a second: the tokenizer, then every token's bytes)."""
        return cls(tokenizer_info(Tokenizer.load(model_path), vocab_size))

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Raises a RequestError (errors.grammar_error) naming what is wrong with the schema, regex or grammar."""
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
            if spec.tool_calls is not None:
                return self._compiler.compile_grammar(tool_calls_ebnf(spec.tool_calls))
            return self._compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as exc:  # xgrammar's C++ errors: keep the message, drop its source location
            raise grammar_error(spec.kind, _clean(str(exc))) from None


def check_grammar_syntax(spec: StructuredOutputsParams) -> None:
    """Refuses a grammar that does not parse (errors.grammar_error), in milliseconds: no token masks.
    For engines in the caller's process (LLMEngine), which then refuse it at once, as the compile would later."""
    try:
        if spec.json is not None:
            text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True)
        elif spec.regex is not None:
            xgr.Grammar.from_regex(spec.regex)
        elif spec.grammar is not None:
            xgr.Grammar.from_ebnf(spec.grammar)
        elif spec.tool_calls is not None:
            tool_calls_ebnf(spec.tool_calls)
    except (RuntimeError, ValueError) as exc:
        raise grammar_error(spec.kind, _clean(str(exc))) from None


def tool_calls_ebnf(tool_calls: ToolCallsGrammar) -> str:
    """The EBNF of one call block (several, one a line, when ``repeat``): the start tag, a JSON call of one of the
    functions whose arguments follow its parameters schema, the end tag."""
    cases = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"]} for f in tool_calls.functions]
    rules = json_schema_ebnf({"anyOf": cases})
    more = ' ("\\n" serval_tool_call)*' if tool_calls.repeat else ""
    start, end = json.dumps(tool_calls.start + "\n"), json.dumps("\n" + tool_calls.end)
    rules += (f"\nserval_tool_calls ::= serval_tool_call{more}\n"
              f"serval_tool_call ::= {start} root {end}\n")
    return with_root(rules, "serval_tool_calls")


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

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], vocab_size: int,
                 compile_timeout_s: float = StructuredOutputConfig.compile_timeout_s) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None  # built by the first compile thread that needs it
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._compiling: dict[str, _Compile] = {}
        self._jobs: queue.SimpleQueue[_Compile | None] = queue.SimpleQueue()
        # Daemon threads: a compile cannot be interrupted, and one must never keep the process from exiting.
        for index in range(COMPILE_THREADS):
            threading.Thread(target=self._compile_jobs, name=f"serval-grammar-{index}", daemon=True).start()

    def _get_compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def prepare(self) -> None:
        """Builds the compiler on a compile thread now, rather than when the first grammar comes."""
        self._jobs.put(None)

    def _compile_jobs(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)  # this thread only (Linux)
        except (AttributeError, OSError):  # elsewhere it stays at the process's priority
            pass
        while True:
            job = self._jobs.get()
            if job is None:  # prepare(): a failure here is the first grammar's to report, not this thread's end
                try:
                    self._get_compiler()
                except Exception:  # noqa: BLE001 - logged; the next job builds it again and fails its request
                    logger.exception("the grammar compiler could not be built")
                continue
            if not job.future.set_running_or_notify_cancel():
                continue  # its request ended while it waited
            try:
                compiler = self._get_compiler()  # the time limit counts from here: the first build is not the grammar's
                job.started = time.monotonic()
                job.future.set_result(xgr.GrammarMatcher(compiler.compile(job.spec)))
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
                failed[request_id] = str(grammar_error(job.spec.kind, "the grammar took longer than "
                                                       f"{self.compile_timeout_s:g} s to compile (the server's "
                                                       "limit); simplify it"))
        return ready, failed

    def wait_compiled(self, timeout: float) -> None:
        """Blocks until a compile ends or ``timeout`` seconds pass (when nothing else is there to run)."""
        futures = [job.future for job in self._compiling.values()]
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)

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
