"""The `serval` command as a user runs it: generate answers through the chat template, models lists what it can
load, and bad flags fail with one clear line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from real_model import requires_model

SERVAL = str(Path(sys.executable).parent / "serval")


@pytest.mark.slow
@requires_model
def test_generate_answers_a_question_through_the_chat_template():
    proc = subprocess.run([SERVAL, "generate", "What is the capital city of Korea?", "--max-tokens", "24",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Seoul" in proc.stdout
    assert "tok/s" in proc.stderr  # the speed line goes to stderr, not into the answer


@pytest.mark.slow
@requires_model
def test_generate_raw_is_a_plain_completion():
    proc = subprocess.run([SERVAL, "generate", "--raw", "The capital city of Korea is", "--max-tokens", "4",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("Seoul")


def test_models_lists_the_embedded_model():
    proc = subprocess.run([SERVAL, "models"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "smollm2-135m-instruct (default)" in proc.stdout and "Q4_1" in proc.stdout


def test_a_bad_engine_flag_fails_with_one_line():
    proc = subprocess.run([SERVAL, "generate", "hi", "--max-num-seqs", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "serval: error: SchedulerConfig.max_num_seqs must be a positive integer, got 0")
