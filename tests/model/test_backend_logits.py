"""The two attention backends a CPU runner can select give the same logits, within the fp32 tolerance the model
tests hold against Hugging Face, over a mixed schedule of chunked prefills and decodes sharing steps."""

from __future__ import annotations

import pytest
import torch
from test_llama import FP32_REL, assert_logits_close, random_ids, save_hf
from tiny_models import SeqStep, full_logits, new_runner, run_step, tiny_llama

from serval.layers.attention.cpu_kernel import CpuKernelBackend
from serval.layers.attention.torch_reference import TorchReferenceBackend
from serval.model.loader import load_model

BLOCK = 8


def _run(runner, tokens: dict[str, list[int]], blocks: dict[str, list[int]], schedule: dict[str, list[int]]):
    """Each sequence's logits over the schedule (tokens per step), its steps sharing the runner's flat batches."""
    done = dict.fromkeys(tokens, 0)
    got: dict[str, list[torch.Tensor]] = {n: [] for n in tokens}
    for step in range(max(len(s) for s in schedule.values())):
        names = [n for n in tokens if step < len(schedule[n])]
        seqs = [SeqStep(tokens[n][done[n]: done[n] + schedule[n][step]], done[n], blocks[n]) for n in names]
        for n, logits in zip(names, run_step(runner, seqs)):
            got[n].append(logits)
            done[n] += schedule[n][step]
    return {n: torch.cat(parts) for n, parts in got.items()}


@torch.inference_mode()
def test_the_kernel_and_the_reference_backend_give_the_same_logits(tmp_path):
    model = load_model(save_hf(tiny_llama(), tmp_path), torch.float32)
    tokens = {"a": random_ids(40, seed=2), "b": random_ids(25, seed=3)}
    blocks = {"a": [4, 9, 1, 6, 11], "b": [0, 7, 2, 10]}
    schedule = {"a": [30] + [1] * 10, "b": [12, 7, 1, 1, 1, 1, 1, 1]}
    kernel_runner = new_runner(model, 12, BLOCK, torch.float32)
    if not isinstance(kernel_runner.attention_backend, CpuKernelBackend):
        pytest.skip("the C++ kernels could not be built here")
    reference_runner = new_runner(model, 12, BLOCK, torch.float32)
    reference_runner.attention_backend = TorchReferenceBackend("cpu", torch.float32, BLOCK)
    by_kernel = _run(kernel_runner, tokens, blocks, schedule)
    by_reference = _run(reference_runner, tokens, blocks, schedule)
    for name, ids in tokens.items():
        assert_logits_close(by_kernel[name], by_reference[name], FP32_REL)
        assert_logits_close(by_reference[name], full_logits(model, ids), FP32_REL)
