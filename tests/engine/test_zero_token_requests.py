"""A request of zero prompt ids that reaches the engine core (past the front end, which refuses it with a 400) is
never queued: it ends at once with an error, holds no KV block, and the core has nothing left to run. Queued, it would
wait for ever: no step schedules a request with nothing to compute."""

from __future__ import annotations

import torch
from tiny_models import tiny_llama

from serval.config import CacheConfig, EngineConfig
from serval.engine.core import EngineCore
from serval.engine.messages import EngineCoreRequest
from serval.model.loader import build_model
from serval.sampling_params import SamplingParams


def test_the_core_fails_a_request_of_no_prompt_ids_at_once_and_queues_nothing(tmp_path):
    tiny_llama().save_pretrained(tmp_path, safe_serialization=True)
    config = EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", cache=CacheConfig(num_blocks=8))
    core = EngineCore(config, tmp_path, build_model(tmp_path, config.settled()))
    core.add_request(EngineCoreRequest("empty", [], SamplingParams(temperature=0, max_tokens=4), [2], 4))
    assert not core.scheduler.has_unfinished_requests()
    outputs = core.step().outputs
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [("empty", "error",
                                                                             "the prompt has no tokens")]
    assert not core.has_unfinished_requests()
    assert core.kv_cache.pool.num_owned_blocks() == 0
    core.add_request(EngineCoreRequest("one", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1), [], 1))
    with torch.inference_mode():
        outputs = core.step().outputs
    assert [(o.request_id, len(o.new_token_ids), o.finish_reason) for o in outputs] == [("one", 1, "length")]
