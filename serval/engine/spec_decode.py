"""Speculative decoding: proposers, and the acceptance rule the runner applies to their guesses.

A proposer guesses a request's next k tokens; the next step runs [last token, guess 1..k] through the target model
in one forward (k + 1 rows of the flat batch, like a short prefill chunk) and samples a token at every row, row i
as if guesses 1..i had been accepted. Guess i + 1 is kept while it equals the token sampled at row i; the first
sampled token that differs, or the one after the last guess, ends the step's tokens.

Why this is exact: the proposers here are deterministic (the guess's proposal distribution is a point mass q = δ_s),
and for such q the modified rejection sampling rule (accept s with min(1, p(s)/q(s)) = p(s), else draw from the
normalised max(0, p - q) = p without s) is the same as drawing x ~ p and accepting s when x == s, else keeping x.
The runner draws each row's token exactly as a decode step would (greedy: argmax; seeded: noise fixed by the seed
and the output position), so a request's tokens are the same with and without speculation.
"""

from __future__ import annotations

import numpy as np

from serval.config import SpeculativeConfig


class NgramProposer:
    """Prompt lookup: finds the latest earlier occurrence of the sequence's last n tokens (n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``) and proposes the tokens that followed it."""

    needs_slots = False  # guesses without computing anything

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose_requests(self, requests, num_tokens: list[int]) -> list[list[int]]:
        return [self.propose(r.all_token_ids, n) for r, n in zip(requests, num_tokens)]

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Every earlier window of n tokens (ending before the suffix itself starts its last token).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start: start + k].tolist()
        return []


def accept(proposed: list[int], sampled: list[int]) -> list[int]:
    """The tokens a step keeps: ``sampled[i]`` is the target's token at row i (after [last, proposed[:i]]);
    proposals are kept while they equal it, then the first differing sampled token (or the bonus one after the
    last proposal) is kept too."""
    kept = []
    for guess, token in zip(proposed, sampled):
        kept.append(token)
        if guess != token:
            return kept
    kept.append(sampled[len(proposed)])
    return kept


class Speculator:
    """Speculative decoding's part of the engine's step, one object: after a step, guesses for the running requests
    (while the batch is small enough for guesses to pay); in the next, the counts of the guesses accepted."""

    def __init__(self, config: SpeculativeConfig, proposer, stats) -> None:
        self.config = config
        self.proposer = proposer  # NgramProposer or draft_proposer.DraftProposer
        self.stats = stats  # the core's EngineCoreStats

    def pays(self, num_running: int) -> bool:
        """Whether guesses are made at this many running requests (SpeculativeConfig.max_batch_size)."""
        return num_running <= self.config.max_batch_size

    def propose(self, running, kv_cache, max_model_len: int, before_draft_writes, valid_prefix) -> None:
        """Sets the guesses of every running request past its prompt. ``before_draft_writes``: called once the
        guessed positions' slots are allocated, before a draft model writes them; ``valid_prefix(request_id,
        guesses)``: the first of the guesses that the request's grammar (if any) allows."""
        if not self.pays(len(running)):
            return
        requests, rooms = [], []
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1 or request.max_tokens == 0:
                continue  # still computing its prompt (or recomputing after a preemption)
            room = min(self.config.num_speculative_tokens,
                       request.max_tokens - len(request.output_token_ids) - 1,  # the step adds one more token
                       max_model_len - request.num_tokens)  # every guess takes a KV slot
            # A draft model writes the guessed positions' KV: their slots (the next step's anyway) come first.
            if room > 0 and (not self.proposer.needs_slots or kv_cache.allocate_slots(request, 1 + room)):
                requests.append(request)
                rooms.append(room)
        if not requests:
            return
        before_draft_writes()  # the slots' allocation may have evicted blocks to save before a draft writes them
        for request, guesses in zip(requests, self.proposer.propose_requests(requests, rooms)):
            request.spec_token_ids = valid_prefix(request.request_id, guesses) if guesses else guesses

    def count_accepted(self, spec_token_ids: dict[str, list[int]], sampled: dict[str, list[int]]) -> None:
        stats = self.stats
        for request_id, guesses in spec_token_ids.items():
            kept = sampled.get(request_id)
            if kept is None:
                continue  # failed or aborted while the step ran
            accepted = len(kept) - 1
            stats.spec_num_drafts += 1
            stats.spec_num_draft_tokens += len(guesses)
            stats.spec_num_accepted_tokens += accepted
            for position in range(accepted):
                stats.spec_accepted_per_position[position] += 1
