"""--enable-expert-parallel on one rank does nothing (every expert is on that rank): the engine says so in a warning
at start-up instead of taking it silently, and runs."""

from __future__ import annotations

from real_model import MODEL_PATH, requires_model
from tiny_models import save_family_dir

from serval.config import EngineConfig
from serval.engine.engine import LLMEngine
from serval.engine.llm import LLM
from serval.sampling_params import SamplingParams

WARNING = "--enable-expert-parallel does nothing on one rank"


@requires_model
def test_expert_parallel_on_one_rank_warns_at_start_up(tmp_path, caplog):
    from serval.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(MODEL_PATH)
    save_family_dir(tmp_path, "qwen3_moe", tokenizer.hf_tokenizer)
    with caplog.at_level("WARNING", logger="serval"):
        llm = LLM.from_engine(LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                                     enable_expert_parallel=True)))
    assert [r.getMessage() for r in caplog.records if WARNING in r.getMessage()] == [
        "--enable-expert-parallel does nothing on one rank: every expert is on this rank (it places whole experts "
        "on the ranks of --tensor-parallel-size > 1)"]
    output = llm.generate(["Once upon a"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 2
