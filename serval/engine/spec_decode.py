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
