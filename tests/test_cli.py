"""The `serval` command as a user runs it: generate answers through the chat template, chat survives Ctrl-C and
quits cleanly, --help shows every default, models lists what it can load, and bad flags fail with one clear line."""

from __future__ import annotations

import argparse
import ast
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from real_model import requires_model

from serval.cli import _api_keys, _engine_config, build_parser, run_chat
from serval.sampling_params import SamplingParams

SERVAL = str(Path(sys.executable).parent / "serval")
REPO = Path(__file__).resolve().parent.parent
# `python -m serval.cli` from the repository root runs this checkout's code, installed or not.
SERVAL_MODULE = [sys.executable, "-m", "serval.cli"]
STORY = "Write a long story about a cat who learns to fly."


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
    # every architecture the loaders take is named, not only Llama's
    assert all(name in proc.stdout for name in ("Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "gemma3", "qwen3moe"))


def test_a_bad_engine_flag_fails_with_one_line():
    proc = subprocess.run([SERVAL, "generate", "hi", "--max-num-seqs", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "serval: error: SchedulerConfig.max_num_seqs must be a positive integer, got 0")


# -- chat and Ctrl-C ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_mid_answer_aborts_that_request_and_frees_its_blocks(make_llm, monkeypatch, capsys):
    engine = make_llm().engine
    lines = iter([STORY, "What is the capital city of Korea?"])

    class TypedLines:
        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            pass

        def read(self, prompt: str) -> str:
            print(prompt, end="")
            try:
                return next(lines)
            except StopIteration:
                raise KeyboardInterrupt from None  # Ctrl-C at the prompt

    finals = {}
    engine_step = engine.step
    num_steps = 0

    def step():
        nonlocal num_steps
        num_steps += 1
        if num_steps == 4:  # the first answer is streaming: Ctrl-C, as the terminal sends it
            signal.raise_signal(signal.SIGINT)
        outputs = engine_step()
        finals.update((o.request_id, o) for o in outputs if o.finished)
        return outputs

    monkeypatch.setattr("serval.cli._StdinLines", TypedLines)
    monkeypatch.setattr(engine, "step", step)
    handler_before = signal.getsignal(signal.SIGINT)
    try:
        code = run_chat(engine, SamplingParams(temperature=0, max_tokens=200))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the chat loop")
    out, err = capsys.readouterr()
    assert code == 0
    assert "chat-0" in finals, "the stopped answer's request never ended in the engine"
    stopped, answered = finals["chat-0"].outputs[0], finals["chat-1"].outputs[0]
    assert stopped.finish_reason == "abort" and 0 < len(stopped.token_ids) < 200
    assert answered.finish_reason == "stop" and "Seoul" in answered.text
    # The stopped request is gone from the engine and holds no KV block.
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.pool.num_owned_blocks() == 0
    assert signal.getsignal(signal.SIGINT) is handler_before
    assert f"assistant> {stopped.text}\nyou> assistant> " in out and "[stopped]" in err
    assert out.endswith("you> \n")  # the shell's prompt will start on a line of its own


class ChatProcess:
    """`serval chat` in a subprocess, fed through a pipe; its stdout is collected as it streams."""

    def __init__(self, tmp_path: Path, *flags: str, sigint: signal.Handlers = signal.SIG_DFL) -> None:
        """``sigint``: the disposition the chat starts with (SIG_IGN is what a script's `cmd &` gives it)."""
        self.stderr_path = tmp_path / "chat.stderr"
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen([*SERVAL_MODULE, "chat", "--dtype", "float32", *flags], cwd=REPO,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                         preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
        self._out = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := os.read(self.proc.stdout.fileno(), 4096):
            self._out += chunk

    @property
    def stdout(self) -> str:
        return self._out.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_for(self, done, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.stdout):
            assert self.proc.poll() is None, f"chat exited ({self.proc.returncode}): {self.stdout}\n{self.stderr}"
            assert time.monotonic() < deadline, f"timed out; stdout so far: {self.stdout!r}"
            time.sleep(0.05)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.slow
@requires_model
@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["sigint-default", "sigint-ignored-at-start"])
def test_chat_ctrl_c_stops_an_answer_then_ctrl_c_at_the_prompt_quits(tmp_path, sigint):
    """Also when the chat starts with SIGINT ignored, as a script's `cmd &` starts it: the answer's Ctrl-C handler used
    to restore that SIG_IGN, and the Ctrl-C at the prompt was then lost (the full suite, run in the background)."""
    chat = ChatProcess(tmp_path, "--max-tokens", "400", sigint=sigint)
    try:
        chat.wait_for(lambda out: out.endswith("you> "))
        chat.send(STORY)
        chat.wait_for(lambda out: len(out.partition("assistant> ")[2]) >= 10)  # the answer is streaming
        chat.proc.send_signal(signal.SIGINT)
        chat.wait_for(lambda out: out.count("you> ") == 2)
        assert "[stopped]" in chat.stderr  # the Ctrl-C hit the answer, not the prompt
        chat.send("What is the capital city of Korea?")  # the chat goes on
        chat.wait_for(lambda out: out.count("you> ") == 3, timeout=120)
        assert "Seoul" in chat.stdout.split("you> ")[2]
        chat.proc.send_signal(signal.SIGINT)  # at the prompt: quit
        try:
            assert chat.proc.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:  # say where it hangs (seen once in a full run, never alone)
            dump = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(chat.proc.pid)],
                                  capture_output=True, text=True, timeout=60)
            raise AssertionError(f"chat did not quit:\n{dump.stdout}{dump.stderr}\n{chat.stderr}") from None
    finally:
        chat.kill()
    chat._reader.join(timeout=10)
    assert chat.stdout.endswith("you> \n")
    assert "Traceback" not in chat.stderr, chat.stderr


class ChatRounds:
    """tests/chat_rounds.py in a subprocess: `serval chat`'s loop, round after round on one engine. Its stdout is read
    on the test's own thread, so a signal can follow the moment a prompt arrives."""

    def __init__(self, tmp_path: Path, num_rounds: int, *flags: str) -> None:
        self.stderr_path = tmp_path / "chat_rounds.stderr"
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "chat_rounds.py"), str(num_rounds),
                                          *flags], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=stderr)
        self.stdout = ""

    def read_until(self, text: str, count: int, timeout: float, after: bool = False) -> None:
        """Reads stdout until ``text`` has appeared ``count`` times (and, with ``after``, 10 characters follow its
        last appearance). Counts, not the tail: one read may bring a round's last lines and the next one's prompt."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while not (self.stdout.count(text) == count and len(self.stdout.rpartition(text)[2]) >= (10 if after else 0)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"stdout's tail: {self.stdout[-300:]!r}")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                assert chunk, f"chat exited ({self.proc.wait()}): {self.stdout[-300:]!r}\n{self.stderr}"
                self.stdout += chunk.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def where_it_waits(self) -> str:
        """Its threads' Python stacks (py-spy) and signal state (pending, blocked, caught), for a failure."""
        dump = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(self.proc.pid)],
                              capture_output=True, text=True, timeout=60)
        signals = []
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            status = Path(f"/proc/{self.proc.pid}/task/{tid}/status").read_text().splitlines()
            signals.append(f"{tid}: " + " ".join(line for line in status if line.startswith(("SigPnd", "ShdPnd",
                                                                                             "SigBlk", "SigCgt"))))
        return dump.stdout + dump.stderr + "\n".join(signals)


@pytest.mark.slow
@requires_model
def test_ctrl_c_at_the_prompt_quits_in_every_round_however_soon_it_follows_the_prompt(tmp_path):
    """Fifty rounds of the Ctrl-C sequence on one engine: Ctrl-C stops an answer, then Ctrl-C at the next prompt quits
    the chat. The second Ctrl-C is sent the moment the prompt arrives in half the rounds, and after a random delay of
    up to 20 ms in the others. input() lost it when it landed after the prompt was written but before the read of
    the line began (every run, within its first rounds): the chat then waited at the prompt for good."""
    num_rounds = 50
    delays = random.Random(0)
    chat = ChatRounds(tmp_path, num_rounds, "--max-tokens", "400")
    try:
        for round_ in range(num_rounds):
            chat.read_until("you> ", 2 * round_ + 1, timeout=300)  # each round has two prompts
            chat.send(STORY)
            chat.read_until("assistant> ", round_ + 1, after=True, timeout=120)  # the answer is streaming
            chat.proc.send_signal(signal.SIGINT)  # stops the answer
            chat.read_until("you> ", 2 * round_ + 2, timeout=120)
            if round_ % 2:
                time.sleep(delays.uniform(0, 0.02))
            chat.proc.send_signal(signal.SIGINT)  # at the prompt: quits this round's chat
            try:
                chat.read_until("you> \n[quit 0]\n", round_ + 1, timeout=30)
            except TimeoutError as exc:
                raise AssertionError(f"round {round_}: Ctrl-C at the prompt was lost ({exc}); the chat waits in:\n"
                                     f"{chat.where_it_waits()}") from None
        assert chat.proc.wait(timeout=60) == 0
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()
            chat.proc.wait()
    assert chat.stderr.count("[stopped]") == num_rounds  # every first Ctrl-C hit an answer, not a prompt
    assert "Traceback" not in chat.stderr, chat.stderr


@pytest.mark.slow
@requires_model
def test_chat_ctrl_d_at_the_prompt_quits(tmp_path):
    proc = subprocess.run([*SERVAL_MODULE, "chat", "--dtype", "float32", "--max-tokens", "24"], cwd=REPO,
                          input="What is the capital city of Korea?\n", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Seoul" in proc.stdout
    assert proc.stdout.endswith("you> \n")  # end of input at the second prompt, and a newline after it
    assert "Traceback" not in proc.stderr


# -- --help ---------------------------------------------------------------------------------------------------------


def _help_entries(help_text: str) -> dict[str, str]:
    """A --help text's option entries by their first option string, whitespace collapsed (wrapping undone)."""
    entries = {}
    for block in re.split(r"\n(?=  -)", help_text)[1:]:
        entry = " ".join(block.split("\n\n")[0].split())
        entries[entry.split()[0].rstrip(",")] = entry
    return entries


def _verb_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"serval": parser, **verbs.choices}


def _unset(default) -> bool:
    return default is None or default is False or default == [] or default is argparse.SUPPRESS


def test_help_shows_the_default_of_every_flag_of_every_verb():
    num_checked = 0
    for verb, parser in _verb_parsers().items():
        text = parser.format_help()
        entries = _help_entries(text)
        for action in parser._actions:
            if not action.option_strings:
                continue
            entry = entries[action.option_strings[0]]
            assert action.help, f"serval {verb} {action.option_strings[0]} has no help text"
            if not _unset(action.default):
                assert f"(default: {action.default})" in entry, f"serval {verb}: {entry}"
                num_checked += 1
        for noise in ("(default: None)", "(default: False)", "(default: [])"):
            assert noise not in text, f"serval {verb} --help shows {noise}"
    assert num_checked >= 3 * 12  # generate, chat and serve each have at least a dozen flags with defaults


def test_generate_help_shows_max_tokens_256_and_temperature_0():
    proc = subprocess.run([*SERVAL_MODULE, "generate", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    entries = _help_entries(proc.stdout)
    assert "(default: 256)" in entries["--max-tokens"]
    assert "(default: 0.0)" in entries["--temperature"]
    args = build_parser().parse_args(["generate", "hi"])
    assert (args.max_tokens, args.temperature) == (256, 0.0)  # what the help says is what a run gets


def test_the_engine_flags_default_to_the_configs_defaults():
    """The engine flags take their defaults from the configs' fields (serval/flags.py): a run gets the configs'."""
    from serval.config import CacheConfig, SchedulerConfig

    for verb in (["serve"], ["generate", "hi"], ["chat"]):
        args = build_parser().parse_args(verb)
        assert args.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens, verb  # None: for the CPU
        assert (args.session_ttl, args.session_cache_fraction) == (CacheConfig().session_ttl,
                                                                   CacheConfig().session_cache_fraction), verb
        cache = CacheConfig()
        assert (args.kv_offload_size, args.kv_offload_path, args.kv_cache_dtype) == (
            cache.kv_offload_size, cache.kv_offload_path, cache.kv_cache_dtype), verb
        assert args.preemption_mode == SchedulerConfig().preemption_mode, verb
    engine = _engine_config(build_parser().parse_args(
        ["serve", "--kv-cache-dtype", "int8", "--kv-offload-size", "2", "--kv-offload-path", "/tmp/kv",
         "--preemption-mode", "swap"]))
    assert (engine.cache.kv_cache_dtype, engine.cache.kv_offload_size, engine.cache.kv_offload_path,
            engine.scheduler.preemption_mode) == ("int8", 2.0, "/tmp/kv", "swap")


def test_device_auto_is_the_default_flag_and_picks_the_devices_defaults(monkeypatch):
    import torch

    for verb in (["serve"], ["generate", "hi"], ["chat"]):
        assert build_parser().parse_args(verb).device == "auto", verb
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    for argv in (["serve"], ["serve", "--device", "auto"]):
        engine = _engine_config(build_parser().parse_args(argv)).settled()
        assert (engine.device, engine.scheduler.max_num_seqs, engine.cache.kv_cache_memory) == ("cpu", 64, 1.0)
        assert engine.scheduler.async_output_processing is False
    help_text = " ".join(_verb_parsers()["serve"].format_help().split())
    assert "(default: 64 on CPU, 256 on CUDA)" in help_text and "; 8192 on CUDA)" in help_text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, without touching a GPU
    engine = _engine_config(build_parser().parse_args(["serve", "--device", "auto", "--dtype", "float32"])).settled()
    assert (engine.device, engine.scheduler.max_num_batched_tokens, engine.scheduler.max_num_seqs) == (
        "cuda", 8192, 256)
    assert (engine.cache.kv_cache_memory, engine.cache.gpu_memory_utilization) == (None, 0.9)  # profiled on the GPU
    assert engine.scheduler.async_output_processing is True
    for switch, value in (("--no-async-output-processing", False), ("--async-output-processing", True)):
        parsed = _engine_config(build_parser().parse_args(["serve", "--dtype", "float32", switch])).settled()
        assert parsed.scheduler.async_output_processing is value, switch
    engine = _engine_config(build_parser().parse_args(
        ["serve", "--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "300",
         "--kv-cache-memory", "3", "--gpu-memory-utilization", "0.5", "--speculative-max-batch-size", "2"])).settled()
    assert (engine.device, engine.scheduler.max_num_batched_tokens, engine.scheduler.max_num_seqs) == (
        "cuda", 300, 8)  # flags given win over the device's defaults
    assert (engine.cache.kv_cache_memory, engine.cache.gpu_memory_utilization,
            engine.speculative.max_batch_size) == (3.0, 0.5, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = _engine_config(build_parser().parse_args(["serve", "--async-output-processing"])).settled()
    assert (engine.device, engine.scheduler.async_output_processing) == ("cpu", True)  # given: kept on a CPU too


def test_a_rank_on_another_machine_resolves_device_auto_as_rank_0_does(monkeypatch):
    import torch

    from serval.engine import workers

    joined = []
    monkeypatch.setattr(workers, "run_worker", lambda *args: joined.append(args))
    argv = ["rank", "--dist-init-method", "tcp://10.0.0.1:29500", "--rank", "1", "--world-size", "2"]
    args = build_parser().parse_args(argv)
    assert args.device == "auto"
    for available, device in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert args.func(args) == 0
        assert joined.pop() == (1, 2, "tcp://10.0.0.1:29500", device, None)
    args = build_parser().parse_args([*argv, "--device", "cuda:1"])
    assert args.func(args) == 0 and joined.pop()[3] == "cuda:1"


def test_a_bad_gpu_memory_utilization_fails_with_one_line():
    proc = subprocess.run([SERVAL, "generate", "hi", "--gpu-memory-utilization", "1.5"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "serval: error: CacheConfig.gpu_memory_utilization must be in (0, 1], got 1.5")


def test_help_never_prints_the_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("SERVAL_API_KEY", "sk-from-the-environment")
    serve = _verb_parsers()["serve"]
    assert "sk-from-the-environment" not in serve.format_help()
    args = serve.parse_args(["--api-key", "sk-flag"])
    assert _api_keys(args.api_key) == ["sk-from-the-environment", "sk-flag"]  # the key still counts


def test_the_generation_config_flags_build_the_engine_configs_fields():
    from serval.config import EngineConfig

    for verb in (["serve"], ["generate", "hi"], ["chat"]):
        args = build_parser().parse_args(verb)
        assert (args.generation_config, args.override_generation_config) == (
            EngineConfig.generation_config, EngineConfig.override_generation_config), verb
    engine = _engine_config(build_parser().parse_args(
        ["serve", "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5, "top_k": 8}']))
    assert (engine.generation_config, engine.override_generation_config) == ("vllm", {"temperature": 0.5, "top_k": 8})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--override-generation-config", "temperature=0.5"])


def test_generate_is_greedy_and_takes_the_models_defaults_for_the_flags_left_unset():
    from serval.cli import _sampling_params

    model = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    params = _sampling_params(build_parser().parse_args(["generate", "hi"]), model)
    assert (params.temperature, params.top_p, params.repetition_penalty, params.top_k) == (0.0, 0.9, 1.1, 0)
    params = _sampling_params(build_parser().parse_args(["generate", "hi", "--top-p", "1", "--temperature", "1"]),
                              model)
    assert (params.temperature, params.top_p) == (1.0, 1.0)


def test_the_command_line_starts_the_core_without_importing_torch_or_numpy():
    """`serve` checks its port before anything heavy loads, and starts the engine core's process as early as it can
    (the core's own imports and load are the start-up's longest path): what the CLI imports up to that point (serval,
    its config, the parser, the core's client) must pull in neither torch, whose import alone takes over a second
    here, nor numpy (0.2 s), nor transformers."""
    code = ("import sys, serval, serval.cli, serval.config, serval.engine.core_client; serval.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# -- one source of truth for every flag and default ----------------------------------------------------------------

SOURCE = REPO / "serval"


def _config_flags():
    """(verb, config or instance, exclude) for every config whose fields make a verb's flags."""
    from serval.cluster.config import RayServeConfig, RouterConfig
    from serval.config import EngineConfig
    from serval.server.config import ROUTER_LISTEN, ListenConfig, ServerConfig
    from serval.server.tls import TLSConfig

    return [(["generate", "hi"], EngineConfig, ("kv_transfer",)), (["chat"], EngineConfig, ("kv_transfer",)),
            (["serve"], EngineConfig, ()), (["serve"], ServerConfig, ()), (["serve"], TLSConfig, ()),
            (["serve"], ListenConfig, ()), (["router", "--replica", "http://r"], ROUTER_LISTEN, ()),
            (["ray-serve"], ListenConfig, ()), (["router"], RouterConfig, ()), (["ray-serve"], RayServeConfig, ())]


def test_every_config_flag_defaults_to_its_fields_default():
    from serval.flags import flag_dest, flag_name, flag_of, flagged_fields

    parsers = _verb_parsers()
    num_checked = 0
    for verb, config, exclude in _config_flags():
        actions = {option: action for action in parsers[verb[0]]._actions for option in action.option_strings}
        args = build_parser().parse_args(verb)
        for field, default in flagged_fields(config, exclude):
            action = actions[flag_name(field)]
            assert action.default == default, (verb, flag_name(field))
            assert getattr(args, flag_dest(field)) == default, (verb, flag_name(field))  # what a run gets
            choices = flag_of(field).choices
            assert (list(action.choices) if action.choices else None) == (list(choices) if choices else None)
            num_checked += 1
    # the engine's flags on 3 verbs, serve's own and TLS, the listen flags on 3 verbs, the router's and Ray Serve's
    assert num_checked >= 3 * 30 + 7 + 5 + 3 * 3 + 8 + 7


def test_verbs_keep_their_ports_and_build_their_configs_from_the_flags():
    assert (build_parser().parse_args(["serve"]).port, build_parser().parse_args(["router"]).port,
            build_parser().parse_args(["ray-serve"]).port) == (8000, 8080, 8000)
    engine = _engine_config(build_parser().parse_args(
        ["serve", "--speculative-model", "none", "--ngram-prompt-lookup-min", "3", "--speculative-max-batch-size", "8",
         "--grammar-compile-timeout", "5", "--no-enable-prefix-caching", "--role", "prefill",
         "--kv-transfer-port", "5000", "--dtype", "float32"]))
    assert (engine.speculative.method, engine.speculative.prompt_lookup_min, engine.speculative.max_batch_size) == (
        None, 3, 8)
    assert (engine.structured_outputs.compile_timeout_s, engine.cache.enable_prefix_caching) == (5.0, False)
    assert (engine.kv_transfer.role, engine.kv_transfer.port, engine.kv_transfer.host) == ("prefill", 5000,
                                                                                          "127.0.0.1")
    generate = _engine_config(build_parser().parse_args(["generate", "hi", "--dtype", "float32"]))
    assert generate.speculative.method == "ngram" and generate.kv_transfer.role == "both"


def test_serve_builds_its_server_config_from_the_flags(monkeypatch):
    from serval.cli import _server_config
    from serval.model.registry import DEFAULT_MODEL
    from serval.server.config import ServerConfig

    monkeypatch.delenv("SERVAL_API_KEY", raising=False)
    config = _server_config(build_parser().parse_args(
        ["serve", "--max-waiting", "3", "--protect-health", "--api-key", "k1", "--rate-limit-rpm", "60"]))
    assert (config.max_waiting, config.protect_health, config.protect_metrics, config.api_keys,
            config.rate_limit_rpm) == (3, True, False, ["k1"], 60)
    assert config.served_model_name == DEFAULT_MODEL == ServerConfig().served_model_name
    named = _server_config(build_parser().parse_args(["serve", "--model", "/no/such/file.gguf"]))
    assert named.served_model_name == "/no/such/file.gguf"  # a name, not a file here: as given


def _flag_definitions(names: set[str]) -> dict[str, list[str]]:
    """Where serval/'s source defines each flag in ``names``: an add_argument call naming it, or a dataclass field
    whose flag(...) metadata makes it (its name= or the field's own name)."""
    found = {name: [] for name in names}
    for path in sorted(SOURCE.rglob("*.py")):
        where = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and arg.value in found:
                        found[arg.value].append(where)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                for call in [c for c in ast.walk(node.value) if getattr(getattr(c, "func", None), "id", "") == "flag"]:
                    names_given = [k.value.value for k in call.keywords if k.arg == "name"]
                    name = names_given[0] if names_given else "--" + node.target.id.replace("_", "-")
                    if name in found:
                        found[name].append(where)
    return found


def test_host_port_and_api_key_are_each_defined_once():
    found = _flag_definitions({"--host", "--port", "--api-key"})
    # `bench serve --api-key` is another flag: the key a benchmark client sends, not keys a server requires.
    found["--api-key"].remove("serval/benchmark/serve.py")
    assert found == {"--host": ["serval/server/config.py"], "--port": ["serval/server/config.py"],
                     "--api-key": ["serval/server/config.py"]}
    parsers = _verb_parsers()
    for option in ("--host", "--port", "--api-key"):
        actions = [next(a for a in parsers[verb]._actions if option in a.option_strings)
                   for verb in ("serve", "router", "ray-serve")]
        assert len({(a.help, a.type, type(a)) for a in actions}) == 1, option


def test_the_default_model_name_is_written_in_one_file():
    """Docstrings aside (examples), the default model's name is a literal in model/registry.py only."""
    from serval.model.registry import DEFAULT_MODEL

    files = set()
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and DEFAULT_MODEL in node.value
                    and id(node) not in docstrings):
                files.add(path.relative_to(REPO).as_posix())
    assert files == {"serval/model/registry.py"}
    bench = _verb_parsers()["bench"]
    bench_serve = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    assert bench_serve.parse_args([]).model == DEFAULT_MODEL
