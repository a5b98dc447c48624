"""The same code on CUDA: greedy text equals the CPU's (float32). Skipped on machines without a GPU."""

from __future__ import annotations

import pytest
import torch
from real_model import requires_model

from serval import LLM, SamplingParams

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
