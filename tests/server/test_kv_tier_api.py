"""The KV cache's disk tier through `serval serve` and the official client, in the default dtype: a server stopped
with SIGTERM leaves its prefix cache in the tier's directory, and the next server on that directory answers the same
prompt from it (usage's cached tokens, the second tier's row of GET /debug/kv, its Prometheus counters)."""

from __future__ import annotations

import httpx
import pytest
from serverproc import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Write two sentences about the lighthouses on the coast of Brittany, "
             "their keepers and the storms of the winter."}]
FLAGS = ["--kv-offload-size", "0.05", "--preemption-mode", "swap"]


def _ask(server: Server):
    return server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)


def test_a_restarted_server_answers_from_the_disk_tier(tmp_path):
    flags = [*FLAGS, "--kv-offload-path", str(tmp_path / "kv")]
    first = Server(flags, tmp_path / "first.log", dtype=None).start().wait_ready()
    try:
        answer = _ask(first)
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        tiers = httpx.get(f"{first.url}/debug/kv", timeout=10).json()["tiers"]
        assert [t["tier"] for t in tiers] == ["cpu", "disk"] and tiers[1]["cached"] == 0  # nothing evicted yet
    finally:
        first.stop()
    assert first.proc.returncode == 0, first.log()[-3000:]

    second = Server(flags, tmp_path / "second.log", dtype=None).start().wait_ready()
    try:
        again = _ask(second)
        prompt_tokens = again.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16 > 0
        assert again.choices[0].message.content == answer.choices[0].message.content
        disk = httpx.get(f"{second.url}/debug/kv", timeout=10).json()["tiers"][1]
        assert disk["tier"] == "disk" and disk["cached"] >= prompt_tokens // 16 and disk["loaded_blocks"] > 0
        metrics = second.metrics()
        assert metrics["serval:kv_offload_hits_total"] == again.usage.prompt_tokens_details.cached_tokens
        assert metrics["serval:kv_offload_blocks_total"] == disk["blocks"] > 0
    finally:
        second.stop()
