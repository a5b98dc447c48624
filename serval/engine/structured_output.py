"""Structured outputs: grammars that constrain a request's tokens, enforced with xgrammar's token bitmasks.

xgrammar was measured against llguidance on this tokenizer (benchmarks/README.md): compile 4-5 ms per schema
against 1.2-1.4 ms, but a mask per token in 19 us (p50) against 343 us, and masks are paid every step.

The front end compiles each request's grammar once to validate it, so a bad schema or regex is refused before the
request is queued; the core compiles it again in its own process (both through xgrammar's cache, keyed by the
grammar) and keeps one matcher per request, advanced by every token the request keeps. Each step the core fills
one bitmask row per position the request samples (several when it checks guesses); the sampler applies the whole
batch's mask at once.
"""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from serval.sampling_params import StructuredOutputsParams
from serval.tokenizer import Tokenizer

# JSON from a schema is written compactly: with free whitespace a small model can loop on newlines forever.
JSON_SEPARATORS = (", ", ": ")


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
            kind = next(name for name in ("json", "json_object", "regex", "choice", "grammar")
                        if getattr(spec, name) not in (None, False))
            raise ValueError(f"invalid structured output {kind}: {_clean(str(exc))}") from None


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


class StructuredOutputManager:
    """The core's matchers, one per constrained request, and the bitmasks they give each step."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._matchers: dict[str, xgr.GrammarMatcher] = {}

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        self._matchers[request_id] = xgr.GrammarMatcher(self.compiler.compile(spec))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

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
