"""The sampler picks the tokens a user would expect from each sampling setting, and reproducibly when seeded."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from serval.layers.sampler import Sampler, SamplingRow, apply_penalties, greedy_tokens
from serval.sampling_params import SamplingParams, takes_argmax_only

sampler = Sampler()


def row(
    params: SamplingParams | None = None,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    blocked: list[int] | None = None,
    device: str = "cpu",
) -> SamplingRow:
    params = params or SamplingParams()
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return SamplingRow(params, list(prompt or []), list(output or []), generator, list(blocked or []))


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def logits_from_probs(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


def support(logits: torch.Tensor, params: SamplingParams, draws: int = 4000, seed: int = 0) -> Counter:
    """Tokens drawn over many independent rows, from the global RNG at a fixed seed."""
    torch.manual_seed(seed)
    batch = logits.expand(draws, -1)
    return Counter(sampler(batch, [row(params) for _ in range(draws)]).token_ids)


def test_greedy_picks_the_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, [row(greedy()) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    assert sampler(torch.tensor([[1.0, 3.0, 3.0]]), [row(greedy())]).token_ids == [1]  # ties: lowest id


def test_greedy_accepts_half_precision_and_leaves_logits_untouched():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = logits.clone()
    rows = [row(greedy(repetition_penalty=1.5), output=[1, 2], blocked=[3]) for _ in range(3)]
    sampler(logits, rows)
    assert torch.equal(logits, before)
    out = sampler(logits, [row(greedy()) for _ in range(3)])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


def test_blocked_ids_are_never_chosen():
    logits = torch.tensor([[5.0, 4.9, 4.8, 0.0, -1.0]])
    assert sampler(logits, [row(greedy(), blocked=[0, 1])]).token_ids == [2]
    drawn = support(logits, SamplingParams(temperature=1.0), draws=2000)
    assert {0, 1} <= set(drawn)
    torch.manual_seed(0)
    batch = logits.expand(2000, -1)
    out = sampler(batch, [row(SamplingParams(temperature=2.0), blocked=[0, 1, 2]) for _ in range(2000)])
    assert set(out.token_ids) == {3, 4}


def test_out_of_vocab_blocked_ids_are_ignored():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert sampler(logits, [row(greedy(), blocked=[7, 0])]).token_ids == [1]


def test_logit_bias_forces_or_bans_a_token_under_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]]).expand(4, -1).contiguous()
    before = logits.clone()
    rows = [row(greedy(logit_bias={3: 100})), row(greedy()), row(greedy(logit_bias={0: -100, 1: -100})),
            row(greedy(logit_bias={7: 100, 0: -1.5}))]  # 7 is outside the vocabulary: ignored
    assert sampler(logits, rows).token_ids == [3, 0, 2, 1]
    assert torch.equal(logits, before)


def test_logit_bias_shifts_the_sampled_distribution():
    logits = torch.zeros(1, 4)
    # +ln 3 on token 2: p = 3/6 for it and 1/6 for the others; -100 on token 0: never drawn
    drawn = support(logits, SamplingParams(temperature=1.0, logit_bias={2: math.log(3), 0: -100}), draws=6000)
    assert 0 not in drawn
    assert drawn[2] / 6000 == pytest.approx(0.6, abs=0.03)  # 3 / (3 + 1 + 1) once token 0 is gone
    # applied before temperature and the filters: top_k=1 keeps the biased token
    assert set(support(logits, SamplingParams(temperature=1.5, top_k=1, logit_bias={1: 1.0}), draws=500)) == {1}


def test_logit_bias_leaves_logprobs_raw():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    out = sampler(logits, [row(greedy(logprobs=1, logit_bias={3: 100}))])
    assert out.token_ids == [3]
    lp = out.logprobs[0]
    assert lp.logprob == pytest.approx(logits.log_softmax(dim=-1)[0, 3].item()) and lp.rank == 4
    assert list(lp.top) == [0]


@pytest.mark.parametrize("bias, message", [
    ({1: 100.5}, "values must be in"),
    ({1: -101}, "values must be in"),
    ({1: "high"}, "values must be in"),
    ({"1": 5}, "keys must be token ids"),
    ({-1: 5}, "keys must be token ids"),
    ([(1, 5)], "must be a dict"),
])
def test_logit_bias_is_validated_at_construction(bias, message):
    with pytest.raises(ValueError, match=f"SamplingParams.logit_bias {message}"):
        SamplingParams(logit_bias=bias)


def test_repetition_penalty_steers_away_from_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -0.5, -0.6]])
    assert sampler(logits, [row(greedy())]).token_ids == [0]
    # 2.0 / 1.2 = 1.67 < 1.9: a token seen in the output loses the lead...
    assert sampler(logits, [row(greedy(repetition_penalty=1.2), output=[0])]).token_ids == [1]
    # ... and so does one seen only in the prompt.
    assert sampler(logits, [row(greedy(repetition_penalty=1.2), prompt=[0])]).token_ids == [1]
    # Negative logits are multiplied, so they move further down: -0.5 * 1.3 = -0.65 < -0.6.
    negative = torch.tensor([[-0.5, -0.6]])
    assert sampler(negative, [row(greedy(repetition_penalty=1.3), output=[0])]).token_ids == [1]
    # A penalty below 1 favours repetition.
    assert sampler(torch.tensor([[1.0, 1.5]]), [row(greedy(repetition_penalty=0.5), output=[0])]).token_ids == [0]


def test_frequency_penalty_grows_with_the_count():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = greedy(frequency_penalty=0.5)
    assert sampler(logits, [row(params, output=[0])]).token_ids == [0]  # 3.0 - 0.5
    assert sampler(logits, [row(params, output=[0, 0, 0])]).token_ids == [1]  # 3.0 - 1.5
    assert sampler(logits, [row(params, prompt=[0, 0, 0, 0])]).token_ids == [0]  # the prompt does not count


def test_presence_penalty_is_flat_and_ignores_the_prompt():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = greedy(presence_penalty=0.8)
    assert sampler(logits, [row(params, output=[0] * 10)]).token_ids == [0]  # 3.0 - 0.8, whatever the count
    assert sampler(torch.tensor([[2.5, 2.0]]), [row(params, output=[0])]).token_ids == [1]  # 2.5 - 0.8
    assert sampler(torch.tensor([[2.5, 2.0]]), [row(params, prompt=[0])]).token_ids == [0]
    # A negative presence penalty encourages reuse.
    assert sampler(torch.tensor([[1.0, 1.5]]), [row(greedy(presence_penalty=-1.0), output=[0])]).token_ids == [0]


def naive_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for b, r in enumerate(rows):
        p = r.params
        counts = Counter(r.output_token_ids)
        for t in set(r.prompt_token_ids) | set(counts):
            if p.repetition_penalty != 1.0:
                v = out[b, t].item()
                out[b, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t, c in counts.items():
            out[b, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_match_a_naive_reference_on_random_logits():
    g = torch.Generator().manual_seed(3)
    vocab = 64
    logits = torch.randn(8, vocab, generator=g) * 3
    settings = [
        dict(),
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.7),
        dict(frequency_penalty=0.6),
        dict(presence_penalty=-0.4),
        dict(repetition_penalty=1.1, frequency_penalty=-0.3, presence_penalty=1.5),
        dict(frequency_penalty=2.0, presence_penalty=2.0),
        dict(repetition_penalty=2.0),
    ]
    rows = []
    for s in settings:
        prompt = torch.randint(0, vocab, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
        rows.append(row(greedy(**s), prompt=prompt, output=output))
    expected = naive_penalties(logits, rows)
    torch.testing.assert_close(apply_penalties(logits, rows), expected)
    assert sampler(logits, rows).token_ids == expected.argmax(dim=-1).tolist()


def test_no_penalties_is_a_no_op():
    logits = torch.randn(2, 10)
    rows = [row(output=[1, 2, 3]), row(prompt=[4])]
    assert apply_penalties(logits, rows) is logits


def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    out = sampler(logits, [row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_the_k_most_likely():
    logits = logits_from_probs([0.05, 0.3, 0.1, 0.4, 0.15])
    assert set(support(logits, SamplingParams(top_k=3))) == {1, 3, 4}
    # Together with top-p, top-k applies first and top-p to what is left.
    assert set(support(logits, SamplingParams(top_k=3, top_p=0.7))) == {1, 3}


def test_top_p_keeps_exactly_the_nucleus():
    logits = logits_from_probs([0.15, 0.05, 0.4, 0.1, 0.3])
    # Sorted: 0.4 (id 2), 0.3 (id 4), 0.15 (id 0): 0.85 is the first cumulative mass >= 0.8.
    assert set(support(logits, SamplingParams(top_p=0.8))) == {2, 4, 0}
    assert set(support(logits, SamplingParams(top_p=0.5))) == {2, 4}
    assert set(support(logits, SamplingParams(top_p=0.2))) == {2}  # the top token always stays


def test_tiny_top_p_equals_greedy():
    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(11))
    out = sampler(logits, [row(SamplingParams(top_p=1e-9)) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_nucleus_with_a_seeded_generator():
    logits = logits_from_probs([0.15, 0.05, 0.4, 0.1, 0.3])
    r = row(SamplingParams(top_p=0.8), seed=123)
    drawn = {sampler(logits, [r]).token_ids[0] for _ in range(500)}
    assert drawn == {2, 4, 0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = logits_from_probs([0.12, 0.5, 0.08, 0.3])
    assert set(support(logits, SamplingParams(min_p=0.2))) == {0, 1, 3}  # threshold 0.1
    assert set(support(logits, SamplingParams(min_p=0.7))) == {1}


def test_filters_mix_per_row_in_one_batch():
    logits = logits_from_probs([0.15, 0.05, 0.4, 0.1, 0.3])
    settings = [SamplingParams(top_k=1), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5), SamplingParams()]
    draws = 1000
    batch = logits.expand(draws * len(settings), -1)
    torch.manual_seed(1)
    out = sampler(batch, [row(p) for p in settings for _ in range(draws)]).token_ids
    supports = [set(out[i * draws : (i + 1) * draws]) for i in range(len(settings))]
    assert supports == [{2}, {2, 4}, {2, 4}, {0, 1, 2, 3, 4}]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    counts = support(logits, SamplingParams(temperature=temperature), draws=40000, seed=7)
    observed = torch.tensor([counts[i] for i in range(6)], dtype=torch.float32) / 40000
    expected = (logits[0] / temperature).softmax(dim=-1)
    torch.testing.assert_close(observed, expected, atol=0.01, rtol=0)


def test_seeded_row_is_reproducible_whatever_shares_its_batch():
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 0.5
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def tokens_alone(steps: int) -> list[int]:
        r = row(params, seed=42)
        return [sampler(logits, [r]).token_ids[0] for _ in range(steps)]

    def tokens_in_batch(position: int, steps: int) -> list[int]:
        r = row(params, seed=42)
        others = [row(SamplingParams(temperature=0.8, top_k=50)) for _ in range(8)]
        others[2] = row(greedy())
        others[5] = row(SamplingParams(seed=7), seed=7)
        rows = others[:position] + [r] + others[position:]
        noise = torch.randn(9, vocab, generator=torch.Generator().manual_seed(position))
        batch = noise.clone()
        batch[position] = logits[0]
        return [sampler(batch, rows).token_ids[position] for _ in range(steps)]

    alone = tokens_alone(6)
    assert len(set(alone)) > 1  # the draw is actually random
    assert tokens_in_batch(0, 6) == alone
    assert tokens_in_batch(4, 6) == alone
    assert tokens_in_batch(8, 6) == alone
    other_seed = row(params, seed=43)
    assert [sampler(logits, [other_seed]).token_ids[0] for _ in range(6)] != alone


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6)) * 2
    rows = [
        row(SamplingParams(temperature=0.7, top_k=5, logprobs=5, repetition_penalty=1.5), output=[1, 2], blocked=[3]),
        row(greedy(logprobs=0)),
        row(SamplingParams(top_p=0.9)),
    ]
    torch.manual_seed(0)
    out = sampler(logits, rows)
    expected = logits.log_softmax(dim=-1)
    for b in (0, 1):
        lp = out.logprobs[b]
        assert lp is not None
        assert lp.token_id == out.token_ids[b]
        assert lp.logprob == pytest.approx(expected[b, lp.token_id].item(), abs=1e-5)
        assert lp.rank == int((expected[b] > expected[b, lp.token_id]).sum()) + 1
    assert out.logprobs[2] is None
    assert out.logprobs[1].rank == 1 and out.logprobs[1].top == {}

    top = out.logprobs[0].top
    assert len(top) == 5
    assert list(top.values()) == sorted(top.values(), reverse=True)
    values, ids = expected[0].topk(5)
    assert list(top) == ids.tolist()
    assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-5)


def test_logprob_rank_of_a_sampled_token_below_the_top():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    out = sampler(logits, [row(greedy(logprobs=2), blocked=[0, 1])])
    assert out.token_ids == [2]
    assert out.logprobs[0].rank == 3
    assert list(out.logprobs[0].top) == [0, 1]


def test_greedy_and_sampled_rows_mix_in_one_batch():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 200, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=9)
    rows = [
        row(greedy()),
        row(seeded, seed=9),
        row(greedy(presence_penalty=2.0), output=[int(logits[2].argmax())]),
        row(SamplingParams(temperature=1.0, top_k=1)),
        row(greedy(logprobs=1)),
        row(SamplingParams(temperature=1.3, top_p=0.5)),
    ]
    out = sampler(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0]
    assert out.token_ids[2] == logits[2].topk(2).indices[1].item()
    assert out.token_ids[3] == argmax[3]
    assert out.token_ids[4] == argmax[4]
    assert out.logprobs[4] is not None and out.logprobs[4].rank == 1
    assert out.token_ids[1] == sampler(logits[1:2], [row(seeded, seed=9)]).token_ids[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_where_it_is_deterministic():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(10))
    bias = {3: 3.0, 9: -100.0}
    rows_cpu = [row(greedy(repetition_penalty=1.2, logprobs=3, logit_bias=bias), output=[1, 5], blocked=[7])
                for _ in range(4)]
    rows_cuda = [row(greedy(repetition_penalty=1.2, logprobs=3, logit_bias=bias), output=[1, 5], blocked=[7])
                 for _ in range(4)]
    cpu, cuda = sampler(logits, rows_cpu), sampler(logits.cuda(), rows_cuda)
    assert cuda.token_ids == cpu.token_ids
    for a, b in zip(cpu.logprobs, cuda.logprobs, strict=True):
        assert a.rank == b.rank and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    params = SamplingParams(top_p=0.9, seed=1)
    first = sampler(logits.cuda()[:1], [row(params, seed=1, device="cuda")]).token_ids
    batch = [row(params, seed=1, device="cuda")] + [row(SamplingParams()) for _ in range(3)]
    assert sampler(logits.cuda(), batch).token_ids[:1] == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_the_samplers_tokens_for_argmax_only_rows(dtype):
    """The runner's greedy fast path: for rows that take the argmax only, one argmax gives the sampler's tokens,
    ties included (the first largest index, as the sampler's), in float32 and bfloat16 logits."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 300, generator=gen).to(dtype)
    logits[3, [5, 17, 200]] = logits[3].max() + 1  # a three-way tie: the first index wins
    logits[4] = 0.0  # all tied
    rows = [row(greedy()) for _ in range(9)]
    assert all(takes_argmax_only(r.params) for r in rows)
    tokens = greedy_tokens(logits)
    assert tokens == sampler(logits, rows).token_ids
    assert tokens[3] == 5 and tokens[4] == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.0, logit_bias={3: 5.0}), SamplingParams(temperature=0.0, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, frequency_penalty=0.5), SamplingParams(temperature=0.0, presence_penalty=0.5),
])
def test_rows_that_need_more_than_an_argmax_do_not_take_it_only(params):
    assert not takes_argmax_only(params)
