"""What the multi-step and async-scheduling tests compare across engine settings: an EngineCore driven over a list of
requests to the end, step by step, as a front end would (the tokens and finish reasons each request got, with every
KV block back in the pool afterwards), and a mixed batch of requests through an LLM on the embedded model (their
final text, tokens and finish)."""

from __future__ import annotations

from serval import LLM
from serval.engine.core import EngineCore
from serval.engine.messages import EngineCoreRequest
from serval.engine.request import RequestStatus
from serval.sampling_params import SamplingParams

EOS = 2


def run_requests(core: EngineCore, requests: list[tuple[list[int], SamplingParams]], late: int = 0,
                 abort_at: dict[int, str] | None = None,
                 logprobs: dict[str, list] | None = None) -> dict[str, tuple[list[int], list[str]]]:
    """Each request's (tokens, finish reasons), request i named "ri" with EOS as its end-of-sequence token; the last
    ``late`` requests are added after the third step, and ``abort_at`` {step: request id} aborts a request after that
    step. ``logprobs``, if given, gets each request's token logprobs (for those that ask)."""
    def add(i):
        prompt, params = requests[i]
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, [EOS], params.max_tokens))

    for i in range(len(requests) - late):
        add(i)
    outputs: dict[str, tuple[list[int], list]] = {}
    step = 0
    while core.has_unfinished_requests():
        step += 1
        if step == 3:
            for i in range(len(requests) - late, len(requests)):
                add(i)
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens, finish = outputs.setdefault(out.request_id, ([], []))
            tokens += out.new_token_ids
            finish.append(out.finish_reason)
            if logprobs is not None and out.new_logprobs:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
        if abort_at and step in abort_at:
            core.finish_requests([abort_at[step]], RequestStatus.FINISHED_ABORTED)
    pool = core.kv_cache.pool
    assert pool.num_owned_blocks() == 0 and pool.num_free_blocks == core.kv_cache.num_blocks
    return {rid: (tokens, [f for f in finish if f is not None]) for rid, (tokens, finish) in outputs.items()}


MIXED_PROMPTS = ["The capital city of Korea is", "def fibonacci(n):", "Once upon a time, in a small village,",
                 "A list of fruits: apple, banana,", "The three primary colors are"]


def mixed_params(one_step: LLM) -> list[SamplingParams]:
    """One request for each of MIXED_PROMPTS: greedy ones that end on eos, on a stop string completed mid-output
    (found with ``one_step``, whose greedy text holds it), on max_tokens and after min_tokens, and a seeded sampled
    one."""
    probe = one_step.generate(MIXED_PROMPTS[1], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    stop = probe.outputs[0].text[20:23]
    return [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=30, stop=[stop]),
            SamplingParams(temperature=0, max_tokens=11), SamplingParams(temperature=0, max_tokens=25, min_tokens=9),
            SamplingParams(temperature=0.7, seed=5, max_tokens=6)]


def mixed_finals(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    """(text, token ids, finish reason, stop reason) of each of MIXED_PROMPTS under ``params``."""
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason)
            for out in llm.generate(MIXED_PROMPTS, params, use_tqdm=False) for c in out.outputs]
