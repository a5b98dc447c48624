"""Hugging Face names: `serval serve Qwen/Qwen2.5-0.5B-Instruct` finds the model in the local Hugging Face cache
(offline, as vLLM does): $HF_HOME/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/<rev>/, the revision refs/main
names. A name not found there fails with one line saying where it looked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from real_model import MODEL_PATH, requires_model
from tiny_files import hf_cache_layout, tiny_hf_dir
from tiny_models import save_family_dir

from serval.cli import _engine_config, build_parser
from serval.model.registry import resolve_model_path

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "TinyOrg/Tiny-Llama-Instruct"


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return home


def test_a_hugging_face_name_resolves_to_the_snapshot_refs_main_names(hf_home, tmp_path):
    snapshot = hf_cache_layout(hf_home, REPO_ID, tiny_hf_dir(tmp_path / "model"), revision="a" * 40)
    (snapshot.parent / ("b" * 40)).mkdir()  # an older revision beside it: refs/main decides
    assert resolve_model_path(REPO_ID) == snapshot
    assert (snapshot / "config.json").is_symlink()


def test_a_hugging_face_name_not_in_the_cache_says_where_it_looked(hf_home):
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("TinyOrg/Missing")
    message = str(info.value)
    assert str(hf_home / "hub" / "models--TinyOrg--Missing") in message and "\n" not in message
    # A local path wins over a name: a directory that exists is never looked up in the cache.
    with pytest.raises(FileNotFoundError, match="neither an embedded model"):
        resolve_model_path(str(hf_home.parent))


def test_serve_takes_the_model_as_its_argument_as_vllm_does():
    assert _engine_config(build_parser().parse_args(["serve", REPO_ID])).model == REPO_ID
    assert _engine_config(build_parser().parse_args(["serve", "--model", REPO_ID])).model == REPO_ID


@requires_model
def test_generate_loads_a_cached_model_by_its_name_and_serve_names_where_it_looked_for_a_missing_one(tmp_path):
    from serval.tokenizer import Tokenizer

    hf_home = tmp_path / "hf-home"
    save_family_dir(tmp_path / "model", "llama", Tokenizer.load(MODEL_PATH).hf_tokenizer)
    hf_cache_layout(hf_home, REPO_ID, tmp_path / "model")
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        env.pop(name, None)
    run = [sys.executable, "-m", "serval.cli"]
    proc = subprocess.run([*run, "generate", "--model", REPO_ID, "--raw", "Once upon a time", "--max-tokens", "3",
                           "--dtype", "float32"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "tokens in" in proc.stderr
    missing = subprocess.run([*run, "serve", "TinyOrg/Missing", "--port", "0"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1] == (
        f"serval: error: model 'TinyOrg/Missing' is no local path and is not in the Hugging Face cache (looked in "
        f"{hf_home / 'hub' / 'models--TinyOrg--Missing'}; Serval reads it offline: download it first, e.g. "
        "`hf download TinyOrg/Missing`)")
