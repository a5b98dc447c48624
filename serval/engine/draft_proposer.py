"""Draft-model speculation: a smaller model (or the first layers of the target) guesses the next tokens greedily.

The draft reads and writes a paged KV cache laid out like the target's and indexed by the same block tables and
slots, so it needs no block accounting of its own:
- ``self-layers:N`` (early exit) runs the target's first N layers and its final norm and head, on the target's own
  cache: the target writes those layers' KV for every token it computes, so the draft is always caught up;
- a separate draft model (any model Serval loads that shares the target's vocabulary) has a cache of its own,
  and runs every step's flat batch right after the target (``mirror``), so its KV covers every token the target
  computed, through prefix-cache hits (a cached block's draft KV was written with its target KV) and preemption
  (recomputed with it).
Guessing runs k one-token steps for all speculating requests at once; the slots of the guessed positions are the
ones the next step's verification writes again, so a rejected guess leaves nothing behind.
"""

from __future__ import annotations

import torch

from serval.engine.request import Request
from serval.engine.runner import ModelRunner, StepInputs
from serval.layers.attention import new_kv_cache


class DraftProposer:
    needs_slots = True  # writes the guessed positions' KV: their blocks must be allocated first

    def __init__(self, runner: ModelRunner, model: torch.nn.Module, num_layers: int | None = None) -> None:
        """``num_layers``: early exit from the target ``model`` after that many layers (sharing its cache);
        None: ``model`` is a separate draft with a cache of its own."""
        self.runner = runner
        self.model = model
        self.shares_cache = num_layers is not None
        if self.shares_cache:
            self.kv_cache = runner.kv_cache[:num_layers]  # the model's layer loop stops where its caches do
        else:
            cfg = model.config
            if cfg.vocab_size != runner.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({cfg.vocab_size} tokens) is not the target's "
                                 f"({runner.vocab_size}): a draft must share the target's tokenizer")
            target = runner.kv_cache
            self.kv_cache = new_kv_cache(cfg.num_layers, target.shape[2], target.shape[3], cfg.num_kv_heads,
                                         cfg.head_dim, target.dtype, target.device)

    @torch.inference_mode()
    def mirror(self, inputs: StepInputs) -> None:
        """Runs the target's step batch through a separate draft, so that its cache keeps up."""
        if not self.shares_cache:
            self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)

    @torch.inference_mode()
    def propose_requests(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to ``num_tokens[i]`` greedy guesses for each request, whose last token's KV is not computed yet and
        whose blocks already hold the slots of the guessed positions."""
        guesses: list[list[int]] = [[] for _ in requests]
        active = [i for i, n in enumerate(num_tokens) if n > 0]
        tokens = [requests[i].all_token_ids[-1] for i in active]
        positions = [requests[i].num_tokens - 1 for i in active]
        for _ in range(max(num_tokens, default=0)):
            if not active:
                break
            meta = self.runner.decode_metadata([requests[i].block_ids for i in active], positions)
            hidden = self.model(self._tensor(tokens), self._tensor(positions), self.kv_cache, meta)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(active, tokens):
                guesses[i].append(token)
            keep = [j for j, i in enumerate(active) if len(guesses[i]) < num_tokens[i]]
            active = [active[j] for j in keep]
            tokens = [tokens[j] for j in keep]
            positions = [positions[j] + 1 for j in keep]
        return guesses

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.runner.device)
