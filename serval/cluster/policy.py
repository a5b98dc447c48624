"""Which replica serves a request: the routing policies, shared by the standalone router (cluster/router.py) and any
other front that spreads requests over Serval replicas. Plain Python, no I/O: a policy sees the prompt's text and
the replicas' state, and says where to go and why.

- ``least_outstanding``: the healthy replica with the fewest requests in flight (ties taken in turn).
- ``cache_aware`` (as SGLang's router): each replica keeps an approximate index of the prompt prefixes it was sent
  (a chain of hashes of fixed-size text chunks, least recently used dropped past a cap). A request goes to the
  replica whose index matches the longest prefix of its prompt, when the match covers at least
  ``cache_threshold`` of the prompt and the load is balanced; otherwise to the least loaded replica, which then
  learns the prompt. Load is unbalanced when the busiest candidate has more than ``balance_abs`` requests beyond the
  idlest and more than ``balance_rel`` times as many: then a prefix match never outweighs a queue.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

CHUNK_CHARS = 64  # prefix granularity: a replica's KV blocks are 16 tokens, about 64 characters of English


@dataclass
class Replica:
    """What the router knows of one replica."""

    url: str
    role: str = "both"  # "prefill" | "decode" | "both" (serve --role): a prefill worker only starts requests
    models: set[str] = field(default_factory=set)  # what its /v1/models lists (learned by the health checks)
    kv_address: str | None = None  # a prefill worker's KV server (its /health says it)
    healthy: bool = True
    outstanding: int = 0  # requests sent and not finished
    routed: int = 0  # requests sent, ever
    consecutive_failures: int = 0  # health checks (or connections) failed in a row
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)  # chunk-chain hashes, least recent first


@dataclass
class RoutingDecision:
    replica: Replica
    reason: str  # for the request log: why this replica
    matched_chars: int = 0  # the prompt's prefix the replica was already sent (cache_aware)


def prefix_hashes(text: str) -> list[int]:
    """Hashes of the text's whole CHUNK_CHARS-character chunks, each chained on the ones before it, so equal hashes
    mean equal prefixes."""
    hashes, parent = [], b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        digest = hashlib.blake2b(parent + text[start: start + CHUNK_CHARS].encode(), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        parent = digest
    return hashes


class LeastOutstanding:
    name = "least_outstanding"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, prompt: str, candidates: list[Replica], tie_break: int | None = None) -> RoutingDecision:
        """``tie_break``: which of the tied replicas (a number from the request, e.g. a hash of its id) where the
        caller may ask more than once per request (Ray Serve's routing retries); None: ties are taken in turn."""
        least = min(r.outstanding for r in candidates)
        tied = [r for r in candidates if r.outstanding == least]
        fewest = min(r.routed for r in tied)  # then the one sent the fewest so far: repeated asks agree
        tied = [r for r in tied if r.routed == fewest]
        replica = tied[(next(self._turn) if tie_break is None else tie_break) % len(tied)]
        return RoutingDecision(replica, f"least outstanding ({least} in flight)")

    def routed(self, prompt: str, replica: Replica) -> None:
        """Told where a request went (cache_aware learns its prompt too)."""
        replica.routed += 1


class CacheAware(LeastOutstanding):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 4, balance_rel: float = 1.5,
                 max_prefixes_per_replica: int = 200_000) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_prefixes = max_prefixes_per_replica

    def choose(self, prompt: str, candidates: list[Replica], tie_break: int | None = None) -> RoutingDecision:
        loads = [r.outstanding for r in candidates]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            decision = super().choose(prompt, candidates, tie_break)
            decision.reason = f"load unbalanced ({min(loads)}-{max(loads)} in flight): {decision.reason}"
            return decision
        hashes = prefix_hashes(prompt)
        best, best_chunks = None, 0
        for replica in candidates:
            chunks = 0
            while chunks < len(hashes) and hashes[chunks] in replica.prefixes:
                chunks += 1
            if chunks > best_chunks or (chunks == best_chunks and best is not None and chunks
                                        and replica.outstanding < best.outstanding):
                best, best_chunks = replica, chunks
        matched = best_chunks * CHUNK_CHARS
        if best is not None and best_chunks and matched >= self.cache_threshold * len(prompt):
            return RoutingDecision(best, f"prefix match {matched}/{len(prompt)} chars", matched)
        decision = super().choose(prompt, candidates, tie_break)
        decision.reason = f"no prefix match over {self.cache_threshold:.0%}: {decision.reason}"
        decision.matched_chars = matched if best is decision.replica else 0
        return decision

    def routed(self, prompt: str, replica: Replica) -> None:
        super().routed(prompt, replica)
        for block_hash in prefix_hashes(prompt):
            replica.prefixes[block_hash] = None
            replica.prefixes.move_to_end(block_hash)
        while len(replica.prefixes) > self.max_prefixes:
            replica.prefixes.popitem(last=False)


POLICIES = {"least_outstanding": LeastOutstanding, "cache_aware": CacheAware}


def make_policy(name: str) -> LeastOutstanding:
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()


def prompt_text(body: dict) -> str:
    """The text a request's KV starts from, as the router sees it (no tokenizer): a completion's prompt, or a chat's
    messages in order (role and content), so requests sharing a system prompt and history share a prefix."""
    if "messages" in body:
        parts = []
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{message.get('role', '')}>{content or ''}")
        return "".join(parts)
    prompt = body.get("prompt", body.get("input", ""))
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else str(prompt)


@dataclass
class VariantRule:
    """When a request matches every condition given, it goes to ``model``. Conditions: the model it names (an
    alias such as "auto"), a header's value, a prompt longer than some characters."""

    model: str
    if_model: str | None = None
    if_header: dict[str, str] = field(default_factory=dict)
    if_prompt_chars_over: int | None = None

    def matches(self, model: str | None, headers: dict[str, str], prompt: str) -> bool:
        return ((self.if_model is None or model == self.if_model)
                and all(headers.get(k.lower()) == v for k, v in self.if_header.items())
                and (self.if_prompt_chars_over is None or len(prompt) > self.if_prompt_chars_over))

    def describe(self) -> str:
        parts = ([f"model {self.if_model}"] if self.if_model else []) + \
            [f"{k}: {v}" for k, v in self.if_header.items()] + \
            ([f"prompt over {self.if_prompt_chars_over} chars"] if self.if_prompt_chars_over is not None else [])
        return " and ".join(parts) or "always"


@dataclass
class VariantRules:
    """Which model variant serves a request: the first rule that matches picks it, then ``aliases`` name it (a
    request may say "mini" or "full"); a request no rule matches keeps its own model. Configuration, as JSON or
    YAML: {"aliases": {"mini": "smollm2-135m-instruct", "full": "gemma3-270m"}, "rules": [{"if": {"header":
    {"x-serval-tier": "premium"}}, "model": "full"}, {"if": {"prompt_chars_over": 4000}, "model": "full"},
    {"if": {"model": "auto"}, "model": "mini"}]}."""

    aliases: dict[str, str] = field(default_factory=dict)
    rules: list[VariantRule] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict) -> VariantRules:
        if not isinstance(raw, dict):
            raise ValueError("routing rules must be a mapping with 'aliases' and 'rules'")
        unknown = set(raw) - {"aliases", "rules"}
        if unknown:
            raise ValueError(f"routing rules: unknown keys {sorted(unknown)} (expected 'aliases', 'rules')")
        rules = []
        for i, rule in enumerate(raw.get("rules") or []):
            condition = rule.get("if") or {}
            extra = set(condition) - {"model", "header", "prompt_chars_over"}
            if "model" not in rule or extra:
                raise ValueError(f"routing rule {i}: needs 'model', and 'if' may hold only model, header, "
                                 f"prompt_chars_over (got {sorted(extra)})")
            rules.append(VariantRule(rule["model"], condition.get("model"), dict(condition.get("header") or {}),
                                     condition.get("prompt_chars_over")))
        return cls(dict(raw.get("aliases") or {}), rules)

    def resolve(self, model: str | None, headers: dict[str, str], prompt: str) -> tuple[str | None, str]:
        """(the model to serve the request, why)."""
        for i, rule in enumerate(self.rules):
            if rule.matches(model, headers, prompt):
                target = self.aliases.get(rule.model, rule.model)
                return target, f"rule {i} ({rule.describe()}) -> {target}"
        target = self.aliases.get(model, model) if model is not None else None
        return target, f"alias {model} -> {target}" if target != model else "as asked"
