"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprobs of the raw model distribution at one position (before penalties, temperature and filters)."""

    token_id: int
    logprob: float  # of the sampled token
    rank: int  # 1 = most likely
    top: dict[int, float]  # top-N token id -> logprob, most likely first (N = params.logprobs; empty when 0)


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative; while unfinished, holds back what could still become a stop string
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    finished: bool = False
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    kv_transfer_params: dict | None = None  # a prefill worker's (engine/kv_transfer.py): where its KV is held

    @property
    def text(self) -> str:
        """The first sample's text (the common n=1 case)."""
        return self.outputs[0].text
