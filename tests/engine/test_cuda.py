"""The same code on CUDA: greedy text equals the CPU's (float32); tensor and pipeline parallelism over NCCL (two
GPUs) and a KV transfer between two engine cores answer as one GPU. Skipped on machines without the GPUs."""

from __future__ import annotations

import pytest
import torch
from real_model import requires_model

from serval import LLM, SamplingParams
from serval.config import CacheConfig, EngineConfig, KVTransferConfig
from serval.engine.core import EngineCore
from serval.engine.engine import LLMEngine
from serval.engine.messages import EngineCoreRequest
from serval.model.registry import resolve_model_path

pytestmark = [pytest.mark.gpu, requires_model,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital city of Korea is", "def fibonacci(n):", "Once upon a time"]


def test_cuda_greedy_equals_cpu():
    params = SamplingParams(temperature=0, max_tokens=24)
    cpu = LLM(dtype="float32", device="cpu").generate(PROMPTS, params, use_tqdm=False)
    gpu_llm = LLM(dtype="float32", device="cuda")
    gpu = gpu_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    assert gpu_llm.engine.runner.kv_cache.device.type == "cuda"


def test_cuda_bfloat16_batch_and_seeded_sampling():
    llm = LLM(dtype="bfloat16", device="cuda")
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=16)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(PROMPTS + [PROMPTS[0]], [SamplingParams(max_tokens=16)] * 3 + [seeded], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    assert llm.engine.kv_cache.pool.num_owned_blocks() == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_two_gpus_over_nccl_answer_as_one(split):
    params = SamplingParams(temperature=0, max_tokens=24)
    one = LLM(dtype="float32", device="cuda").generate(PROMPTS, params, use_tqdm=False)
    llm = LLM.from_engine(LLMEngine(EngineConfig(dtype="float32", device="cuda", **split)))
    try:
        assert llm.engine.core.worker.group.device.type == "cuda"
        two = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_cuda_kv_transfer_between_a_prefill_and_a_decode_core():
    path = resolve_model_path(None)
    # Three cores in one process: each a fixed 1 GiB cache, not the share of the free memory a lone engine takes.
    cache = CacheConfig(kv_cache_memory=1.0)
    single = EngineCore(EngineConfig(device="cuda", cache=cache), path)
    prefill = EngineCore(EngineConfig(device="cuda", cache=cache, kv_transfer=KVTransferConfig(role="prefill")), path,
                         model=single.model)
    decode = EngineCore(EngineConfig(device="cuda", cache=cache, kv_transfer=KVTransferConfig(role="decode")), path,
                        model=single.model)
    eos = []

    def run(core, request_id, kv, max_tokens=16):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, kv_transfer_params=kv)
        core.add_request(EngineCoreRequest(request_id, list(range(100, 160)), params, eos, max_tokens))
        tokens, held = [], None
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                assert out.error is None, out.error
                tokens += out.new_token_ids
                held = out.kv_transfer_params or held
        return tokens, held

    try:
        expected, _ = run(single, "s", None)
        _, held = run(prefill, "p", {"do_remote_decode": True}, 1)
        got, _ = run(decode, "d", {**held, "do_remote_prefill": True})
        assert got == expected and decode.snapshot().kv_received_blocks == 4
    finally:
        for core in (single, prefill, decode):
            core.shutdown()

