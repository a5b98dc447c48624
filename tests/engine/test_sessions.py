"""Conversation sessions on the real model, in the default dtype: a turn that names a session keeps its KV, so the
next turn computes only its new tokens even after other traffic has cycled the cache; without a session the same
traffic evicts the conversation. The answer is the same either way."""

from __future__ import annotations

import pytest

from serval.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=24)
QUESTION = "Tell me about the history of the bicycle in a few sentences."
FOLLOW_UP = "And who invented the pedal?"
# Other users' prompts, each about 60 tokens: together several times the free blocks of a 24-block cache.
TRAFFIC = [f"Request {i}: " + "Describe the weather, the sea, the harbour and the boats of a small town. " * 4
           for i in range(10)]


def _run(engine, request_id: str, prompt: list[int], params: SamplingParams = GREEDY, **session):
    engine.add_request(request_id, prompt, params, **session)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output
    return final


def _conversation(llm, session: dict) -> tuple:
    """Turn 1, the traffic, turn 2. Returns (turn 1 output, turn 2 output, turn 2's computed tokens)."""
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    messages = [{"role": "user", "content": QUESTION}]
    first = _run(engine, "turn-1", tokenizer.apply_chat_template(messages), **session)
    for i, text in enumerate(TRAFFIC):
        _run(engine, f"other-{i}", tokenizer.encode(text), SamplingParams(temperature=0, max_tokens=4))
    messages += [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": FOLLOW_UP}]
    before = engine.stats.num_scheduled_tokens
    second = _run(engine, "turn-2", tokenizer.apply_chat_template(messages), **session)
    return first, second, engine.stats.num_scheduled_tokens - before


def test_the_next_turn_computes_only_its_new_tokens(make_llm):
    kwargs = dict(dtype="bfloat16", num_blocks=24, speculative_model=None, max_num_batched_tokens=128)
    with_session = make_llm(**kwargs)
    first, second, computed = _conversation(with_session, {"session_id": "conv-1"})
    turn_1_ids = first.prompt_token_ids + first.outputs[0].token_ids
    shared = next((i for i, (a, b) in enumerate(zip(turn_1_ids, second.prompt_token_ids)) if a != b),
                  min(len(turn_1_ids), len(second.prompt_token_ids)))
    assert shared > len(first.prompt_token_ids)  # the answer's tokens are the next prompt's too
    # Every full block turn 1 computed (its last token's KV never is) and the next prompt shares is reused.
    assert second.num_cached_tokens == min(shared, len(turn_1_ids) - 1) // 16 * 16 > len(first.prompt_token_ids)
    assert computed == len(second.prompt_token_ids) - second.num_cached_tokens + len(second.outputs[0].token_ids) - 1
    stats = with_session.engine.stats
    assert (stats.session_requests, stats.session_hit_tokens) == (1, second.num_cached_tokens)
    kv = with_session.engine.kv_cache
    assert list(kv.sessions) == ["conv-1"] and kv.num_session_blocks == len(kv.sessions["conv-1"].block_ids) > 0

    without = make_llm(**kwargs)  # the same traffic with no session: the conversation is gone from the cache
    first_plain, second_plain, computed_plain = _conversation(without, {})
    assert second_plain.num_cached_tokens == 0 and computed_plain > computed
    assert second_plain.outputs[0].token_ids == second.outputs[0].token_ids  # kept KV changes no token
    assert first_plain.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_last_turn_and_an_ended_session_keep_nothing(make_llm):
    llm = make_llm(dtype="bfloat16", num_blocks=64, speculative_model=None)
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    _run(engine, "a", prompt, session_id="conv")
    assert engine.kv_cache.num_session_blocks > 0
    assert engine.end_session("conv") and not engine.end_session("conv")
    assert engine.kv_cache.num_session_blocks == 0 and engine.kv_cache.pool.num_owned_blocks() == 0
    _run(engine, "b", prompt, session_id="conv")
    _run(engine, "c", prompt, session_id="conv", end_session=True)  # its last turn: it still reads the kept KV
    assert engine.stats.session_requests == 1 and not engine.kv_cache.sessions
    assert engine.kv_cache.pool.num_owned_blocks() == 0


def test_the_kv_view_never_lists_an_expired_session(make_llm):
    """An idle engine takes no step, so the view ends what is past its TTL itself."""
    llm = make_llm(dtype="bfloat16", num_blocks=64, speculative_model=None, session_ttl=0.0)
    engine = llm.engine
    _run(engine, "a", engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]), session_id="s")
    assert engine.kv_cache.sessions  # kept when the turn ended, expired since
    state = engine.kv_state()
    assert state["sessions"]["kept"] == [] and state["tiers"][0]["owned"] == 0
