"""An engine client with the real front end (InputProcessor) and no core, for server tests of what the front end
refuses: a request it lets through is recorded in ``queued`` and fails the test."""

from __future__ import annotations

from serval.config import EngineConfig
from serval.engine.client import EngineClient
from serval.engine.frontend import InputProcessor
from serval.engine.messages import EngineCoreInfo, EngineCoreStats


class FrontEndOnly(EngineClient):
    context_policy, load_time = "error", 0.0

    def __init__(self, tokenizer, model: str = "tiny", vocab_size: int = 1000, max_model_len: int = 64) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.inputs = InputProcessor(EngineConfig(), tokenizer,
                                     EngineCoreInfo(model, max_model_len, vocab_size, 16, 0.0, max_model_len))
        self.queued: list[str] = []

    @property
    def is_alive(self) -> bool:
        return True

    def snapshot(self) -> EngineCoreStats:
        return EngineCoreStats()

    async def add_request(self, request_id, prompt, params, priority=0, *args):
        self.inputs.process(request_id, prompt, params, priority)
        self.queued.append(request_id)
        raise AssertionError("the front end took a request it should have refused")
