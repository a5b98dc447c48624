"""Engine behaviour on the real embedded model: greedy outputs never depend on how requests are batched, chunked,
cached or preempted — in the default dtype (bfloat16) and in float32; KV blocks are always given back; sampling and
stops behave."""

from __future__ import annotations

import pytest

from serval.layers.linear import BlockQuantLinear, use_activation_quantization
from serval.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

_SENTENCES = [
    "The capital city of Korea is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "The three primary colors are",
    "Photosynthesis is the process by which plants",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "A list of fruits: apple, banana,",
    "The quick brown fox",
]
# 17 prompts of mixed lengths (about 5 to 80 tokens); some share long prefixes. "Count from 15:" is a near-tie
# that once flipped with batch composition in bfloat16.
PROMPTS = [(" ".join(_SENTENCES[: 1 + i % 8]) + " " + s) for i, s in enumerate(_SENTENCES * 2)] + ["Count from 15:"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _texts(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def reference(make_llm, dtype):
    """Each prompt run alone: the truth every other schedule must reproduce."""
    llm = make_llm(dtype=dtype, max_num_seqs=1)
    return _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def _assert_no_owned_blocks(llm):
    pool = llm.engine.kv_cache.pool
    assert pool.num_owned_blocks() == 0
    assert pool.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_prompts_have_mixed_lengths(make_llm):
    llm = make_llm()
    lengths = sorted(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert lengths[0] < 16 and lengths[-1] > 64


def test_batch_of_16_equals_one_by_one(make_llm, dtype, reference):
    llm = make_llm(dtype=dtype, enable_prefix_caching=False)
    assert _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    _assert_no_owned_blocks(llm)


@pytest.mark.parametrize("budget", [7, 32, 100])
def test_chunked_prefill_equals_unchunked(make_llm, dtype, reference, budget):
    llm = make_llm(dtype=dtype, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.stats.num_steps > len(PROMPTS)  # the long prompts really were cut into chunks
    _assert_no_owned_blocks(llm)


@pytest.fixture(scope="module")
def int8_activations(make_llm):
    """bfloat16 with int8 activations (EngineConfig.activation_quantization) on the shared model: each prompt run
    alone, the truth for that setting; the shared model is set back to float activations afterwards."""
    llm = make_llm(dtype="bfloat16", max_num_seqs=1, activation_quantization="int8")
    yield _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    use_activation_quantization(llm.engine.model, "none")


@pytest.mark.parametrize("budget", [None, 7])  # None: the batch of 16 unchunked (the default budget, 512)
def test_int8_activations_keep_greedy_output_independent_of_batch_and_chunks(make_llm, int8_activations, budget):
    """The int8 kernel quantizes each row by itself (csrc/int8_linear.cpp): a batch of 16 and chunked prefills give
    each prompt's output alone."""
    llm = make_llm(dtype="bfloat16", enable_prefix_caching=False, activation_quantization="int8",
                   **({} if budget is None else {"max_num_batched_tokens": budget}))
    assert all(m.activation_quantization == "int8" for m in llm.engine.model.modules()
               if isinstance(m, BlockQuantLinear))
    assert _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == int8_activations
    _assert_no_owned_blocks(llm)


@pytest.mark.parametrize("dot_products", ["fma", "bf16", "amx"])
def test_each_block_kernel_keeps_greedy_output_independent_of_batch_and_chunks(make_llm, dot_products):
    """Each kernel for bfloat16 rows on the GGUF blocks (EngineConfig.block_dot_products; "auto" is one of them; "amx"
    the dot products on AMX tiles): each prompt's greedy tokens alone equal its tokens in a batch of 16 and in
    chunked prefills."""
    alone = make_llm(dtype="bfloat16", max_num_seqs=1, block_dot_products=dot_products)
    if alone.engine.core.dot_products != dot_products:
        pytest.skip(f"the {dot_products} kernel needs AVX-512 BF16 (amx: and AMX-BF16 tiles)")
    assert all(m.dot_products == dot_products for m in alone.engine.model.modules()
               if isinstance(m, BlockQuantLinear) and set(m.formats) & {"q4", "q8"})
    want = _texts(alone.generate(PROMPTS, GREEDY, use_tqdm=False))
    for budget in (512, 7):
        llm = make_llm(dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=budget,
                       block_dot_products=dot_products)
        assert _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        _assert_no_owned_blocks(llm)


def test_prefix_cache_hit_computes_less_and_changes_nothing(make_llm, dtype, reference):
    llm = make_llm(dtype=dtype, enable_prefix_caching=True)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    computed_first = llm.engine.stats.num_scheduled_tokens
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    computed_second = llm.engine.stats.num_scheduled_tokens - computed_first
    assert _texts(first) == reference and _texts(second) == reference
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 16)
    # Every cached prompt token is a token not computed: each run computed exactly the uncached prompt tokens
    # plus every generated token but the last (which is never fed back).
    for outputs, computed in ((first, computed_first), (second, computed_second)):
        expected = sum(len(o.prompt_token_ids) - o.num_cached_tokens + len(o.outputs[0].token_ids) - 1
                       for o in outputs)
        assert computed == expected
    assert computed_second < computed_first
    assert llm.engine.kv_cache.stats.hit_tokens >= sum(o.num_cached_tokens for o in second)
    _assert_no_owned_blocks(llm)


def test_preemption_recompute_changes_nothing(make_llm, dtype, reference):
    # 30 blocks of 16 tokens cannot hold 16 requests of up to ~100 tokens: the scheduler must preempt.
    llm = make_llm(dtype=dtype, num_blocks=30, enable_prefix_caching=False)
    assert _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_no_owned_blocks(llm)


def test_preemption_with_prefix_cache_changes_nothing(make_llm, dtype, reference):
    llm = make_llm(dtype=dtype, num_blocks=30, enable_prefix_caching=True, max_num_batched_tokens=64)
    assert _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_no_owned_blocks(llm)


# With async output processing the abort lands while a step's outputs wait for the front end, and the detokenizer
# fails while the device computes the next step (tests/engine/test_async_output_processing.py has the rest).
@pytest.mark.parametrize("async_output_processing", [False, True])
def test_no_block_owned_after_finished_aborted_and_failed(make_llm, async_output_processing):
    llm = make_llm(async_output_processing=async_output_processing)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=40))
    for _ in range(3):
        engine.step()
    engine.abort_request("r1")  # running
    engine.add_request("late", PROMPTS[6], SamplingParams(max_tokens=5))
    engine.abort_request("late")  # still waiting
    # A request whose output processing fails: only it ends, with an error.
    _, sample = engine.outputs.samples["r2"]

    def broken(token_id):
        raise RuntimeError("detokenizer exploded")

    sample.detokenizer.add = broken
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["r1"].outputs[0].finish_reason == "abort"
    assert finals["late"].outputs[0].finish_reason == "abort"
    assert finals["r2"].outputs[0].finish_reason == "error" and "exploded" in finals["r2"].error
    for rid in ("r0", "r3", "r4", "r5"):
        assert finals[rid].outputs[0].finish_reason in ("stop", "length")
        assert finals[rid].error is None
    _assert_no_owned_blocks(llm)


def test_seeded_sampling_is_reproducible_regardless_of_batch(make_llm):
    llm = make_llm()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = llm.generate([PROMPTS[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20) for _ in range(7)]
    batch = llm.generate(PROMPTS[2:9] + [PROMPTS[1]], others + [seeded], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=20)
    assert llm.generate([PROMPTS[1]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_string_cut_across_token_boundaries(make_llm):
    llm = make_llm()
    prompt = "The capital city of Korea is"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].text
    assert "Tokyo" in full
    # "kyo" starts inside the token " Tokyo": the stop must still cut there, and nothing of it leaks.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=["kyo", "zzz"]),
                       use_tqdm=False)[0]
    assert out.text == full[: full.index("kyo")]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "kyo"
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=["kyo"],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == full[: full.index("kyo") + 3]


def test_the_earliest_stop_string_in_the_text_ends_it_whatever_their_order(make_llm):
    """All stop strings are matched in one pass over the new text: the one that begins first cuts it, so the text
    holds none of them (" Tokyo" is one token, in which "kyo" and "Tok" complete together)."""
    llm = make_llm()
    prompt = "The capital city of Korea is"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].text
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=["kyo", "zzz", "Tok"]),
                       use_tqdm=False)[0]
    assert out.text == full[: full.index("Tok")]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "Tok"


def test_streamed_text_never_leaks_a_stop_string(make_llm):
    engine = make_llm().engine
    engine.add_request("s", "The capital city of Korea is", SamplingParams(temperature=0, max_tokens=30,
                                                                            stop=["Tokyo"]))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.text)
    assert all("Tok" not in t for t in seen[:-1])  # held back while it could still become the stop string
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))  # each text extends the previous one


@pytest.mark.parametrize("prompt, wanted", [
    ("Korean: 안녕하세요 means hello. 감사합니다 means", "안녕하세요"),  # Hangul: 3 bytes a character
    ("Emoji list: 🦊 fox, 🐶 dog, 🐱 cat,", "🐵"),  # 4 bytes, split over byte-level tokens
])
def test_utf8_streams_whole_characters(make_llm, prompt, wanted):
    engine = make_llm().engine
    engine.add_request("u", prompt, SamplingParams(temperature=0, max_tokens=30))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.text for o in engine.step()]
    deltas = [b[len(a):] for a, b in zip([""] + texts, texts)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == texts[-1]
    assert wanted in texts[-1]  # the model really wrote multi-byte characters


def test_stop_token_ids_min_tokens_ignore_eos(make_llm):
    llm = make_llm()
    chat = [{"role": "user", "content": "What is the capital city of Korea?"}]
    plain = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert plain.finish_reason == "stop" and plain.token_ids[-1] == 2
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=len(plain.token_ids) + 3),
                      use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) >= len(plain.token_ids) + 3 and 2 not in forced.token_ids[:-1]
    ignore = llm.chat(chat, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert len(ignore.outputs[0].token_ids) == 20 and ignore.outputs[0].finish_reason == "length"
    stop_at = plain.token_ids[2]
    stopped = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == plain.token_ids[:3] and stopped.stop_reason == stop_at


def test_n_samples_share_the_prompt_blocks(make_llm):
    llm = make_llm()
    prompt = PROMPTS[7]  # long enough for several full blocks
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct samples
    # Siblings 1..3 reused the first one's full prompt blocks instead of computing them again.
    num_prompt = len(out.prompt_token_ids)
    full_blocks = (num_prompt - 1) // 16 * 16
    stats = llm.engine.stats
    rejected_guesses = stats.spec_num_draft_tokens - stats.spec_num_accepted_tokens  # run, then overwritten
    computed = stats.num_scheduled_tokens - rejected_guesses
    assert computed <= num_prompt + 3 * (num_prompt - full_blocks) + 4 * 12
    _assert_no_owned_blocks(llm)


def test_logprobs_are_returned_per_token(make_llm):
    llm = make_llm()
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for token_id, lp in zip(out.outputs[0].token_ids, lps):
        assert lp.token_id == token_id and lp.rank == 1  # greedy picks the most likely token
        assert len(lp.top) == 3 and max(lp.top.values()) == pytest.approx(lp.logprob)


def test_bad_input_is_rejected_and_leaves_others_alone(make_llm, dtype, reference):
    llm = make_llm(dtype=dtype)
    engine = llm.engine
    engine.add_request("good", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("empty", "", GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [1, 2, 10**9], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("long", [1] * 3000, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("big", PROMPTS[0], SamplingParams(max_tokens=4000))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([PROMPTS[1], ""], GREEDY, use_tqdm=False)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.request_id == "good" and final.outputs[0].token_ids == reference[0]
    _assert_no_owned_blocks(llm)


def test_priority_runs_important_requests_first(make_llm):
    llm = make_llm(max_num_seqs=1)
    engine = llm.engine
    engine.add_request("low", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3), priority=5)
    engine.add_request("high", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]  # first come, first served would have run "low" first
