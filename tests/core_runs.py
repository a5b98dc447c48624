"""Drives an EngineCore over a list of requests to the end, step by step, as a front end would: the tokens and finish
reasons each request got, with every KV block back in the pool afterwards (the multi-step and async-scheduling
tests compare these across engine settings)."""

from __future__ import annotations

from serval.engine.core import EngineCore, EngineCoreRequest
from serval.engine.request import RequestStatus
from serval.sampling_params import SamplingParams

EOS = 2


def run_requests(core: EngineCore, requests: list[tuple[list[int], SamplingParams]], late: int = 0,
                 abort_at: dict[int, str] | None = None) -> dict[str, tuple[list[int], list[str]]]:
    """Each request's (tokens, finish reasons), request i named "ri" with EOS as its end-of-sequence token; the last
    ``late`` requests are added after the third step, and ``abort_at`` {step: request id} aborts a request after that
    step."""
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
        if abort_at and step in abort_at:
            core.finish_requests([abort_at[step]], RequestStatus.FINISHED_ABORTED)
    pool = core.kv_cache.pool
    assert pool.num_owned_blocks() == 0 and pool.num_free_blocks == core.kv_cache.num_blocks
    return {rid: (tokens, [f for f in finish if f is not None]) for rid, (tokens, finish) in outputs.items()}
