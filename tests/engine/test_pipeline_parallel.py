"""Pipeline parallelism over 2 real processes (torch.distributed, gloo) on the embedded model, in the default dtype
and weights: each rank runs a run of whole layers and hands the hidden states on, so the arithmetic is one
process's: prompt logprobs and greedy text equal bitwise, alone and batched (a batch runs as one micro-batch per
stage, so the stages overlap), through the engine and through `serval serve --pipeline-parallel-size 2`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from serval.config import CacheConfig, EngineConfig, SpeculativeConfig
from serval.engine.core import EngineCore
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM
from serval.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from real_model import requires_model  # noqa: E402
from serverproc import Server  # noqa: E402

pytestmark = [pytest.mark.slow, requires_model, pytest.mark.timeout(900)]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colours of the rainbow:"]


def _llm(pipeline_parallel_size: int) -> LLM:
    return LLM.from_engine(LLMEngine(EngineConfig(pipeline_parallel_size=pipeline_parallel_size,
                                                  cache=CacheConfig(kv_cache_memory=0.1))))


def test_two_stages_give_one_process_logprobs_and_text_bitwise():
    params = SamplingParams(max_tokens=32, temperature=0, prompt_logprobs=3, logprobs=2)
    one = _llm(1)
    try:
        single = one.generate(PROMPTS, params, use_tqdm=False)
    finally:
        one.engine.shutdown()
    llm = _llm(2)
    try:
        stage = llm.engine.core.model
        assert (stage.start, stage.end, stage.config.num_layers) == (0, 15, 15)  # rank 0: the first 15 of 30
        assert llm.engine.core.runner.kv_cache.shape[0] == 15  # ... and only their KV cache
        micro_batches = []  # each step's micro-batch count: stages overlap when it is 2
        pipelined = stage.pipelined
        stage.pipelined = lambda batches, kv: (micro_batches.append(len(batches)), pipelined(batches, kv))[1]
        batched = llm.generate(PROMPTS, params, use_tqdm=False)
        assert micro_batches and set(micro_batches) == {2}
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    finally:
        llm.engine.shutdown()
    for a, b, c in zip(single, batched, alone):
        assert a.outputs[0].text == b.outputs[0].text == c.outputs[0].text and a.outputs[0].text
        for x, y, z in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], c.prompt_logprobs[1:]):
            assert (x.logprob, x.top) == (y.logprob, y.top) == (z.logprob, z.top)
        assert [t.top for t in a.outputs[0].logprobs] == [t.top for t in b.outputs[0].logprobs]


def test_a_step_splits_into_one_micro_batch_per_stage_of_about_equal_tokens():
    from types import SimpleNamespace

    from serval.engine.request import Request
    from serval.engine.runner import ModelRunner
    from serval.engine.scheduler import SchedulerOutput

    runner = SimpleNamespace(group=SimpleNamespace(num_stages=2), model=SimpleNamespace(pipelined=None))
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(6)]
    tokens = [1, 1, 1, 1, 1, 128]  # five decodes, then a prompt chunk
    out = SchedulerOutput(requests, {r.request_id: t for r, t in zip(requests, tokens)}, spec_token_ids={"r0": [7]})
    parts = ModelRunner._micro_batches(runner, out)
    assert [[r.request_id for r in p.scheduled] for p in parts] == [["r0", "r1", "r2", "r3", "r4"], ["r5"]]
    assert parts[0].spec_token_ids == {"r0": [7]} and parts[1].num_scheduled_tokens == {"r5": 128}
    even = SchedulerOutput(requests[:4], {r.request_id: 1 for r in requests[:4]})
    assert [len(p.scheduled) for p in ModelRunner._micro_batches(runner, even)] == [2, 2]
    one = SchedulerOutput(requests[:1], {"r0": 5})
    assert ModelRunner._micro_batches(runner, one) == [one]


def test_serve_with_two_stages_answers_as_one_process(tmp_path):
    answers = {}
    for size in (1, 2):
        server = Server(["--pipeline-parallel-size", str(size)], tmp_path / f"pp{size}.log", dtype=None)
        try:
            client = server.start().wait_ready().client()
            answers[size] = [client.chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": p}], max_tokens=24,
                temperature=0).choices[0].message.content for p in PROMPTS[:2]]
        finally:
            server.stop()
    assert answers[2] == answers[1] and all(answers[1])


def test_a_draft_model_a_loaded_model_or_bad_rank_counts_are_refused():
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2).world_size == 4  # both kinds at once
    with pytest.raises(ValueError, match="num_local_ranks"):
        EngineConfig(pipeline_parallel_size=2, num_local_ranks=3)
    with pytest.raises(ValueError, match="tcp://"):
        EngineConfig(pipeline_parallel_size=2, dist_init_method="10.0.0.1:29500")
    with pytest.raises(ValueError, match="no draft model"):
        EngineConfig(pipeline_parallel_size=2, speculative=SpeculativeConfig(method="self-layers:4"))
    with pytest.raises(ValueError, match="cannot be split over ranks"):  # before any rank is started
        EngineCore(EngineConfig(pipeline_parallel_size=2), "unused.gguf", model=object())
