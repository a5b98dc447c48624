"""The router's policies (serval/cluster/policy.py), on plain replica state: least outstanding takes turns among the
idlest; cache-aware follows the longest known prompt prefix unless the match is short or the load unbalanced."""

from __future__ import annotations

import pytest

from serval.cluster.policy import (
    CHUNK_CHARS,
    CacheAware,
    LeastOutstanding,
    Replica,
    VariantRules,
    make_policy,
    prefix_hashes,
    prompt_text,
)

SYSTEM = "You are a careful assistant who answers questions about trains and timetables. " * 8


def test_prefix_hashes_name_whole_prefixes():
    a, b = prefix_hashes(SYSTEM + "When is the next train?"), prefix_hashes(SYSTEM + "Where is platform 4?")
    shared = len(SYSTEM) // CHUNK_CHARS
    assert a[:shared] == b[:shared] and a[shared:] != b[shared:]
    assert set(prefix_hashes("x" + SYSTEM)).isdisjoint(prefix_hashes(SYSTEM))  # chained: one change, all differ
    assert prefix_hashes("short") == []


def test_least_outstanding_picks_the_idlest_and_takes_turns_among_ties():
    policy = LeastOutstanding()
    a, b, c = Replica("a", outstanding=2), Replica("b"), Replica("c")
    assert [policy.choose("p", [a, b, c]).replica.url for _ in range(4)] == ["b", "c", "b", "c"]
    a.outstanding = 0
    assert policy.choose("p", [a, b, c]).reason == "least outstanding (0 in flight)"


def test_cache_aware_follows_the_longest_prefix_unless_short_or_unbalanced():
    policy = CacheAware(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)
    a, b = Replica("a"), Replica("b")
    first = policy.choose(SYSTEM + "Q1", [a, b])
    assert first.replica is a and first.reason.startswith("no prefix match")
    policy.routed(SYSTEM + "Q1", a)
    policy.routed("Something else entirely, " * 20, b)
    again = policy.choose(SYSTEM + "Q2", [a, b])
    assert again.replica is a and again.matched_chars == len(SYSTEM) // CHUNK_CHARS * CHUNK_CHARS
    assert again.reason.startswith("prefix match")
    a.outstanding = 3  # busier, but within the balance: the cache still wins
    assert policy.choose(SYSTEM + "Q3", [a, b]).replica is a
    a.outstanding = 6  # 6 - 0 > 4 and 6 > 1.5 * 0: unbalanced, the idlest gets it
    unbalanced = policy.choose(SYSTEM + "Q4", [a, b])
    assert unbalanced.replica is b and unbalanced.reason.startswith("load unbalanced")
    a.outstanding = 0
    short = policy.choose(SYSTEM[:70] + "A question much longer than the shared part. " * 10, [a, b])
    assert short.reason.startswith("no prefix match")  # one chunk of ~500 characters: under the threshold


def test_a_replicas_prefix_index_is_capped_least_recently_used_first():
    policy = CacheAware(max_prefixes_per_replica=10)
    replica = Replica("a")
    policy.routed(SYSTEM, replica)  # 10 chunks
    policy.routed("z" * (CHUNK_CHARS * 3), replica)
    assert len(replica.prefixes) == 10
    assert prefix_hashes(SYSTEM)[0] not in replica.prefixes and prefix_hashes(SYSTEM)[3] in replica.prefixes


def test_the_prompt_text_of_each_endpoint_and_a_bad_policy_name():
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert prompt_text(chat) == "<system>S<user>Hi"
    assert prompt_text({"prompt": ["one", "two"]}) == "one" and prompt_text({"input": "x"}) == "x"
    with pytest.raises(ValueError, match="cache_aware"):
        make_policy("random")


def test_variant_rules_pick_a_model_by_alias_header_or_prompt_length():
    rules = VariantRules.from_dict({
        "aliases": {"mini": "small-model", "full": "big-model"},
        "rules": [{"if": {"header": {"X-Tier": "premium"}}, "model": "full"},
                  {"if": {"model": "auto", "prompt_chars_over": 100}, "model": "full"},
                  {"if": {"model": "auto"}, "model": "mini"}]})
    assert rules.resolve("auto", {}, "short")[0] == "small-model"
    assert rules.resolve("auto", {}, "x" * 101) == ("big-model",
                                                    "rule 1 (model auto and prompt over 100 chars) -> big-model")
    assert rules.resolve("mini", {"x-tier": "premium"}, "short")[0] == "big-model"  # headers arrive lower-cased
    assert rules.resolve("mini", {}, "short") == ("small-model", "alias mini -> small-model")
    assert rules.resolve("other", {}, "short") == ("other", "as asked")
    with pytest.raises(ValueError, match="unknown keys"):
        VariantRules.from_dict({"alias": {}})
    with pytest.raises(ValueError, match="routing rule 0"):
        VariantRules.from_dict({"rules": [{"if": {"length": 3}, "model": "x"}]})
