"""Configuration: one validated dataclass per concern, built from CLI flags and Python kwargs alike.

A field with ``flag(...)`` metadata is a command-line flag (serval/flags.py): its default, type and choices here are
the flag's, and its help is the flag's help."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serval.flags import flag, json_object, none_or_text
from serval.sampling_params import GENERATION_CONFIG_DEFAULT, check_sampling_defaults

if TYPE_CHECKING:
    import torch

# torch is imported where a value needs it, not here: the CLI reads these choices and defaults without paying for it
# (a `serve` on a port in use fails at once).
_DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *_DTYPE_NAMES)


def cache_directory() -> Path:
    """Where Serval keeps what it derives from model files (a joined multi-part file, a converted tokenizer):
    $SERVAL_CACHE_DIR, else ~/.cache/serval."""
    return Path(os.environ.get("SERVAL_CACHE_DIR", Path.home() / ".cache" / "serval"))


def auto_dtype(device: str) -> str:
    """The dtype that is fast on this hardware: bfloat16 where it computes in it natively (CPUs with AVX-512 bf16,
    most GPUs), else float32 on CPU (without native bf16, a bf16 linear runs 1.6-6x slower than fp32) and float16
    on a GPU without bf16."""
    import torch

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def resolve_device(device: str) -> str:
    """``device`` with "auto" made "cuda" when torch sees a GPU, else "cpu" (vLLM's choice)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_kind(device: str) -> str:
    """The key of a device's defaults: "cuda" for cuda and cuda:N, else "cpu"."""
    return "cuda" if device.startswith("cuda") else "cpu"


class DeviceDefaults:
    """A config some of whose defaults belong to the device (``device_defaults``): a field left None takes the
    CPU's value when the config is built (alone, it runs on a CPU), and another device's in the copy that
    ``for_device`` makes (EngineConfig.settled). A value given at construction always stays."""

    _device_defaulted: tuple[str, ...] = ()  # the fields left None at construction (not a dataclass field)

    def device_defaults(self, kind: str) -> dict[str, Any]:
        raise NotImplementedError

    def _take_cpu_defaults(self) -> None:
        """At construction: the fields left None take the CPU's values, and are remembered."""
        defaults = self.device_defaults("cpu")
        self._device_defaulted = tuple(name for name in defaults if getattr(self, name) is None)
        for name in self._device_defaulted:
            setattr(self, name, defaults[name])

    def for_device(self, device: str):
        """A copy whose fields left None at construction have ``device``'s defaults (a GPU's may be None: decided
        later, as the KV cache's size is by profiling)."""
        defaults = self.device_defaults(device_kind(device))
        settled = copy.copy(self)
        for name in self._device_defaulted:
            setattr(settled, name, defaults[name])
        return settled


KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
CPU_KV_CACHE_GIB = 1.0


@dataclass
class CacheConfig(DeviceDefaults):
    """The paged KV cache: block size and how much memory it may take."""

    block_size: int = field(default=16, metadata=flag("tokens per KV cache block"))
    # All layers' keys and values. None: the device's default, a fixed size on a CPU; on a GPU (one process) sized by
    # profiling (engine/memory_profile.py): ``gpu_memory_utilization`` of the memory a forward of the largest step
    # leaves free.
    kv_cache_memory: float | None = field(default=None, metadata=flag(
        f"GiB for the KV cache (default: {CPU_KV_CACHE_GIB:g} on CPU; on CUDA, --gpu-memory-utilization of the GPU "
        "memory left free after loading the model and a profiling forward pass)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        "on CUDA without --kv-cache-memory: the share of the GPU memory left free after loading the model and a "
        "forward of the largest step that the KV cache takes, in (0, 1]"))
    num_blocks: int | None = None  # overrides kv_cache_memory (tests use it to force preemption)
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "reuse the KV blocks of a prompt prefix computed before"))
    # Conversation sessions (requests with a session id; they need prefix caching): how long a finished turn's KV
    # is kept for the next turn, and the share of the blocks all sessions together may hold.
    session_ttl: float = field(default=600.0, metadata=flag(
        "seconds a conversation's KV is kept after a turn that named a session (chat requests' session_id or user)"))
    session_cache_fraction: float = field(default=0.5, metadata=flag(
        "the share of the KV cache that kept conversations may hold"))
    # The second tier (engine/kv_offload.py): GiB for blocks evicted from the KV cache and for swapped-out requests
    # (0: none), in host RAM, or in a memory-mapped file in the directory ``kv_offload_path`` (kept across restarts).
    kv_offload_size: float = field(default=0.0, metadata=flag(
        "GiB for the KV cache's second tier: blocks evicted from the KV cache (found again by their prefix) and "
        "swapped-out requests; 0: none"))
    kv_offload_path: str | None = field(default=None, metadata=flag(
        "keep the second tier in a memory-mapped file in DIR (kept across restarts) instead of host RAM",
        metavar="DIR"))
    # "auto": the model's dtype; "int8", "fp8_e4m3", "fp8_e5m2": 8-bit codes with a float32 scale per token and head
    # (layers/attention/), about 1.9x the tokens in the same memory.
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "the KV cache's elements: the model's dtype (auto), or 8-bit codes with a scale per token and head (about "
        "1.9x the tokens in the same memory)", choices=KV_CACHE_DTYPE_CHOICES))

    def device_defaults(self, kind: str) -> dict[str, Any]:
        return {"kv_cache_memory": CPU_KV_CACHE_GIB if kind == "cpu" else None}  # None: profiled

    def __post_init__(self) -> None:
        self._take_cpu_defaults()
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"CacheConfig.kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if not (isinstance(self.kv_offload_size, (int, float)) and self.kv_offload_size >= 0):
            raise ValueError(f"CacheConfig.kv_offload_size must be >= 0 GiB, got {self.kv_offload_size!r}")
        if self.kv_offload_path is not None and not self.kv_offload_size:
            raise ValueError("CacheConfig.kv_offload_path needs kv_offload_size > 0 (the disk tier's size)")
        if not (isinstance(self.session_ttl, (int, float)) and self.session_ttl >= 0):
            raise ValueError(f"CacheConfig.session_ttl must be >= 0 seconds, got {self.session_ttl!r}")
        if not (isinstance(self.session_cache_fraction, (int, float)) and 0 <= self.session_cache_fraction <= 1):
            raise ValueError("CacheConfig.session_cache_fraction must be in [0, 1], "
                             f"got {self.session_cache_fraction!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"CacheConfig.block_size must be a positive integer, got {self.block_size!r}")
        if not (isinstance(self.kv_cache_memory, (int, float)) and self.kv_cache_memory > 0):
            raise ValueError(f"CacheConfig.kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError("CacheConfig.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise ValueError(f"CacheConfig.num_blocks must be an integer >= 2, got {self.num_blocks!r}")


PREEMPTION_MODES = ("auto", "recompute", "swap")


def default_token_budget() -> int:
    """Tokens computed per engine step by default, for the CPU this runs on.

    A step's prefill chunk delays every decode in it, so the budget bounds inter-token latency under a mixed load.
    Measured through the server on the mixed workload (benchmarks/README.md): with AVX-512 a budget of 128 gave an ITL
    p99 of 235 ms (304 at 192, 372 at 256) for 11% more wall time than 256; held to AVX2 (8-lane float32 FMAs, half
    the arithmetic rate) 128 gave 310 ms, 112 269 ms and 96 246 ms at the same wall time (58-59 s)."""
    from serval.platform_info import cpu_capability

    return 128 if cpu_capability() == "AVX512" else 96


# A GPU's step costs about the same from 1 to hundreds of rows (it reads the weights once), so it takes vLLM's limits.
CPU_MAX_NUM_SEQS = 64
CUDA_MAX_NUM_SEQS = 256
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
# Forwards a decode step runs in a row on CUDA (SchedulerConfig.num_scheduler_steps). Measured on an H200
# (benchmarks/bench_gpu.sh, the embedded model, bf16, 128 tokens, offline at 1/16/64/256 streams): 1 gave 540/6,931/
# 19,552/27,111 tok/s, 8 gave 865/12,032/39,770/85,346 and 16 785/10,577/28,334/49,825.
CUDA_NUM_SCHEDULER_STEPS = 8


@dataclass
class SchedulerConfig(DeviceDefaults):
    """Continuous batching limits: tokens per step and sequences per step (None: the device's defaults)."""

    max_num_batched_tokens: int | None = field(default=None, metadata=flag(  # None: default_token_budget() on CPU
        "tokens computed per engine step (default: 128 on a CPU with AVX-512, else 96; "
        f"{CUDA_MAX_NUM_BATCHED_TOKENS} on CUDA)"))
    max_num_seqs: int | None = field(default=None, metadata=flag(
        f"requests running at once (default: {CPU_MAX_NUM_SEQS} on CPU, {CUDA_MAX_NUM_SEQS} on CUDA)"))
    enable_chunked_prefill: bool = field(default=True, metadata=flag(
        "cut long prompts into chunks that share a step with running decodes"))
    # What a preempted request's KV becomes: dropped and recomputed, swapped to the KV cache's second tier and back
    # (CacheConfig.kv_offload_size), or whichever costs less as measured (swap without a second tier: recompute).
    preemption_mode: str = field(default="auto", metadata=flag(
        "a preempted request's KV: recomputed later, swapped to the second tier and back, or whichever costs less "
        "as measured (auto; recompute without a second tier)", choices=PREEMPTION_MODES))
    # The offline engine's front end (detokenizing, stop strings, outputs) works on step N's tokens while the device
    # computes step N+1, so its outputs come one step later. It pays where the device computes apart from the host
    # (a GPU); on a CPU the forward holds the host, so there it only delays outputs. None: the device's default.
    async_output_processing: bool | None = field(default=None, metadata=flag(
        "the offline engine detokenizes a step's tokens while the device computes the next step (default: on for "
        "CUDA, off on CPU)"))
    # Multi-step decoding: a step of decodes only (each row's token drawn from its logits alone: greedy or sampled,
    # with logprobs if asked, without penalties) runs up to this many forwards in a row on the device, each one's
    # tokens the next one's inputs, before the host reads the tokens and schedules again. The host's work
    # (scheduling, stop checks, outputs) is paid once per run instead of once per token, which is what a GPU waits
    # on with a small model; tokens then reach a stream in runs of up to this many. None: the device's default.
    num_scheduler_steps: int | None = field(default=None, metadata=flag(
        "a step of decodes (greedy or sampled, without penalties) runs up to this many forwards in a "
        "row on the device before the host schedules "
        f"again (default: {CUDA_NUM_SCHEDULER_STEPS} on CUDA, 1 on CPU)"))
    # Async scheduling (vLLM's name) of multi-step runs: the next run of the same decodes is queued on the
    # device before the host reads this run's tokens, so the device computes it while the host checks stops,
    # reports and schedules (engine/core.py, EngineCore._run). A request that stopped in a run wastes its share of
    # the queued one. Off by default until measured on a GPU (benchmarks/README.md); on a CPU the forward holds the
    # host, so nothing overlaps there.
    async_scheduling: bool = field(default=False, metadata=flag(
        "with multi-step decoding, queue a run of decodes on the device before reading the last run's "
        "tokens, so the host's work overlaps the device's"))

    def device_defaults(self, kind: str) -> dict[str, Any]:
        if kind == "cuda":
            return {"max_num_batched_tokens": CUDA_MAX_NUM_BATCHED_TOKENS, "max_num_seqs": CUDA_MAX_NUM_SEQS,
                    "async_output_processing": True, "num_scheduler_steps": CUDA_NUM_SCHEDULER_STEPS}
        return {"max_num_batched_tokens": default_token_budget(), "max_num_seqs": CPU_MAX_NUM_SEQS,
                "async_output_processing": False, "num_scheduler_steps": 1}

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"SchedulerConfig.preemption_mode must be one of {list(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        self._take_cpu_defaults()
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError("SchedulerConfig.max_num_batched_tokens must be a positive integer, "
                             f"got {self.max_num_batched_tokens!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"SchedulerConfig.max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1:
            raise ValueError("SchedulerConfig.num_scheduler_steps (--num-scheduler-steps) must be a positive integer, "
                             f"got {self.num_scheduler_steps!r}")


QUANTIZATION_CHOICES = ("auto", "none", "gguf", "gptq", "awq", "int8", "fp8")
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names: the file's weights, or random ones of the model's shape
ACTIVATION_QUANTIZATION_CHOICES = ("auto", "none", "int8")
BLOCK_DOT_PRODUCT_CHOICES = ("auto", "fma", "bf16", "amx")
CONTEXT_POLICIES = ("error", "sliding_window")  # a chat longer than the context: refused, or its oldest turns dropped
EARLY_EXIT_PREFIX = "self-layers:"
CPU_SPECULATIVE_MAX_BATCH_SIZE = 4
# On a GPU a decode step replays a CUDA graph while a step that checks guesses runs eagerly: measured on an H200
# (benchmarks/bench_gpu.py, the embedded model, bf16, 128 tokens), n-gram speculation at one stream gave 128 tok/s
# against 499 without, so on CUDA it is off at every batch size (0) until guess-checking steps are captured too.
CUDA_SPECULATIVE_MAX_BATCH_SIZE = 0


@dataclass
class SpeculativeConfig(DeviceDefaults):
    """Speculative decoding: a proposer guesses the next tokens, one target forward checks them all.

    ``method`` None is off; "ngram" (the default) proposes by prompt lookup: the tokens that followed the latest
    earlier occurrence of the sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``);
    "self-layers:N" guesses greedily with the target's first N layers (early exit); "self-int4" with the target's
    own GGUF file read in its 4-bit blocks; anything else names a draft model (an embedded name or a path, as
    ``EngineConfig.model``) that shares the target's tokenizer.
    On by default: greedy and seeded outputs are unchanged and sampled ones keep their distribution, and measured
    (benchmarks/README.md) it gave 1.9x one stream's tokens/s on prose, 2.3x on quoting chat, 1.5x on free chat,
    and within 5% either way at 16 streams, where max_batch_size turns it off."""

    method: str | None = field(default="ngram", metadata=flag(
        "speculative decoding: ngram guesses the next tokens by prompt lookup, self-layers:N with the model's first "
        "N layers, MODEL with a draft model sharing the tokenizer; one forward checks the guesses (greedy and "
        "seeded output unchanged); none: off", name="--speculative-model", metavar="ngram|none|self-layers:N|MODEL",
        type=none_or_text))
    num_speculative_tokens: int = field(default=4, metadata=flag("tokens guessed per step"))
    prompt_lookup_min: int = field(default=2, metadata=flag("shortest n-gram looked up",
                                                            name="--ngram-prompt-lookup-min"))
    prompt_lookup_max: int = field(default=4, metadata=flag("longest n-gram looked up",
                                                            name="--ngram-prompt-lookup-max"))
    # Speculate only while at most this many requests run: a large batch is compute-bound already, and verifying
    # guesses costs more than they save. Measured offline (greedy chat, this CPU): free chat 1.19x at 1 request,
    # 1.01x at 2 and 4, 0.93x at 8; quoting chat 2.26x at 1 down to 1.13x at 16. None: the device's; 0: never.
    max_batch_size: int | None = field(default=None, metadata=flag(
        f"speculate only while at most this many requests run, 0: never (default: {CPU_SPECULATIVE_MAX_BATCH_SIZE} "
        f"on CPU, {CUDA_SPECULATIVE_MAX_BATCH_SIZE} on CUDA)", name="--speculative-max-batch-size"))

    def device_defaults(self, kind: str) -> dict[str, Any]:
        return {"max_batch_size": CUDA_SPECULATIVE_MAX_BATCH_SIZE if kind == "cuda" else CPU_SPECULATIVE_MAX_BATCH_SIZE}

    def __post_init__(self) -> None:
        self._take_cpu_defaults()
        if self.method is not None and (not isinstance(self.method, str) or not self.method or self.method == "none"):
            raise ValueError("SpeculativeConfig.method must be None, 'ngram', 'self-layers:N' or a draft model, "
                             f"got {self.method!r}")
        if self.method is not None and self.method.startswith(EARLY_EXIT_PREFIX):
            layers = self.method.removeprefix(EARLY_EXIT_PREFIX)
            if not layers.isdecimal() or int(layers) < 1:
                raise ValueError(f"SpeculativeConfig.method {self.method!r}: N in self-layers:N must be a positive "
                                 "integer")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_batch_size"):
            value = getattr(self, name)
            least = 0 if name == "max_batch_size" else 1  # 0 requests: never speculate
            if not isinstance(value, int) or value < least:
                raise ValueError(f"SpeculativeConfig.{name} must be an integer >= {least}, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("SpeculativeConfig.prompt_lookup_min must be <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} > {self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def early_exit_layers(self) -> int | None:
        """N of "self-layers:N", else None."""
        if self.method is None or not self.method.startswith(EARLY_EXIT_PREFIX):
            return None
        return int(self.method.removeprefix(EARLY_EXIT_PREFIX))

    @property
    def draft_model(self) -> str | None:
        """The draft model's name or path, when ``method`` names one."""
        if self.method in (None, "ngram", "self-int4") or self.early_exit_layers is not None:
            return None
        return self.method


KV_ROLE_CHOICES = ("both", "prefill", "decode")


@dataclass
class KVTransferConfig:
    """Disaggregated prefill/decode (engine/kv_transfer.py): which side of a KV transfer this engine is.

    "both" (the default): a whole worker, no transfers. "prefill": a request that asks for it keeps its prompt's KV
    when it ends and serves it at ``host``:``port`` (0: a free port) until a decode worker fetches it or
    ``timeout`` seconds pass. "decode": a request that names such a transfer fetches the blocks its own prefix cache
    lacks and computes only the prompt's last token."""

    role: str = field(default="both", metadata=flag(
        "disaggregated prefill/decode (README): prefill computes prompts and holds their KV for decode workers; "
        "decode fetches it and generates; both: a whole worker, no transfers", choices=KV_ROLE_CHOICES))
    host: str = field(default="127.0.0.1", metadata=flag(
        "a prefill worker's address for decode workers to fetch held KV from", name="--kv-transfer-host"))
    port: int = field(default=0, metadata=flag("a prefill worker's KV port (0: a free one)",
                                               name="--kv-transfer-port"))
    timeout: float = field(default=30.0, metadata=flag(
        "seconds a prefill worker holds a prompt's KV that no decode worker fetches", name="--kv-transfer-timeout"))

    def __post_init__(self) -> None:
        if self.role not in KV_ROLE_CHOICES:
            raise ValueError(f"KVTransferConfig.role must be one of {list(KV_ROLE_CHOICES)}, got {self.role!r}")
        if not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise ValueError(f"KVTransferConfig.port must be a TCP port (0: any free one), got {self.port!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"KVTransferConfig.timeout must be > 0 seconds, got {self.timeout!r}")


@dataclass
class StructuredOutputConfig:
    """Limits on a request's grammar (engine/structured_output.py): past them it is refused with a 400 naming its
    field. xgrammar's compile time grows faster than the grammar (measured on this tokenizer: 1,000 optional JSON
    properties 1-1.5 s, 3,000 about 4 s, 30,000 over 7 minutes; 5,000 choices 0.1 s, 20,000 15 s), and a compile
    cannot be stopped once started, so sizes are checked before any compile, and the time limit fails the request
    of a grammar that is small but slow anyway."""

    max_schema_bytes: int = 256 * 1024  # a JSON schema's text
    max_schema_members: int = 2_000  # properties, enum values and anyOf/oneOf/allOf branches, the whole schema over
    max_choices: int = 5_000
    max_choice_chars: int = 256 * 1024  # all choices together
    max_regex_chars: int = 16 * 1024
    max_grammar_chars: int = 256 * 1024  # an EBNF grammar (a tool call's included)
    compile_timeout_s: float = field(default=30.0, metadata=flag(  # from the compile's start
        "a request's grammar (guided_json, response_format, ...) that takes longer to compile is refused with a 400",
        name="--grammar-compile-timeout", metavar="SECONDS"))

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_schema_members", "max_choices", "max_choice_chars", "max_regex_chars",
                     "max_grammar_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StructuredOutputConfig.{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.compile_timeout_s, (int, float)) and self.compile_timeout_s > 0):
            raise ValueError(f"StructuredOutputConfig.compile_timeout_s must be > 0 seconds, "
                             f"got {self.compile_timeout_s!r}")


@dataclass
class EngineConfig:
    """Everything the engine needs: which model, on what, and the cache and scheduler settings."""

    model: str | None = field(default=None, metadata=flag(  # None: the embedded default model
        "embedded model name, .gguf file or HF directory (default: the embedded model that `serval models` marks "
        "as the default)"))
    dtype: str = field(default="auto", metadata=flag(  # "auto": auto_dtype(device), in settled()
        "weights, activations and KV cache; auto: bfloat16 where the CPU (or GPU) computes in it natively, else "
        "float32 (float16 on a GPU)", choices=DTYPE_CHOICES))
    # "auto" is resolved by settled(): cuda when torch sees a GPU, else cpu. The sub-configs' fields left None
    # then take the device's defaults (DeviceDefaults).
    device: str = field(default="auto", metadata=flag("cpu, cuda[:N], or auto: cuda when torch sees a GPU, else cpu"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "context length in tokens (default: the model's own, if the KV cache holds it)"))
    context_policy: str = field(default="error", metadata=flag(
        "a chat longer than the context: reject it, or drop the oldest turns", choices=CONTEXT_POLICIES))
    load_format: str = field(default="auto", metadata=flag(
        "auto: the weights of the model's file or directory; dummy: random weights of its shape (a directory with "
        "only a config.json and a tokenizer is enough), for benchmarks of models not at hand", choices=LOAD_FORMATS))
    # "auto": the file's own 4- to 8-bit blocks (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on the CPU,
    # where a C++ kernel reads them, or a GPTQ/AWQ checkpoint's 4-bit groups as the same kernel's blocks (see
    # serval.model.loader.resolve_quantization), else "none"; "none": dequantize to dtype; "gguf": the file's
    # blocks; "gptq", "awq": the checkpoint's; "int8": weight-only int8 with per-row scales; "fp8": the decoder's
    # linears in float8 e4m3 with per-row scales, activations per token (serval/layers/fp8_linear.py).
    quantization: str = field(default="auto", metadata=flag(
        "weights as the GGUF file stores them (gguf: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K read in place by a CPU "
        "kernel) or as a GPTQ or AWQ checkpoint's 4-bit groups (gptq, awq: the same kernel), dequantized to --dtype "
        "(none), weight-only int8 (int8), or FP8 e4m3 weights quantized per output channel at load with activations "
        "quantized per token (fp8: FP8 GEMMs on a GPU of compute capability 8.9+, refused on older ones; on the CPU "
        "a slow emulation of the same numerics); auto: gguf, gptq or awq on the CPU for a file or directory with such "
        "weights, else none", choices=QUANTIZATION_CHOICES))
    # How the CPU kernel multiplies the file's blocks (serval/layers/csrc/int8_linear.cpp): "none", float32
    # activations (the file's weights exactly); "int8", activations quantized per row and block of 32, integer dot
    # products (faster; the cost in perplexity is in benchmarks/README.md); "auto", int8 where it measured faster
    # than the float kernels on this CPU (serval/layers/linear.py: int8_activations_faster). Batch invariance holds
    # for each.
    activation_quantization: str = field(default="auto", metadata=flag(
        "with GGUF or GPTQ/AWQ blocks on the CPU: int8 quantizes the activations per block of 32 and multiplies "
        "with integer dot products (VNNI or AVX2), as llama.cpp does; none keeps them float32; auto takes int8 where "
        "it measured faster than the float kernels at one row and not slower at 16 on this CPU",
        choices=ACTIVATION_QUANTIZATION_CHOICES))
    # How the CPU kernel multiplies bfloat16 activations with q4, q4k, q6k and q8 blocks (Q4_0, Q4_1, Q4_K, Q6_K,
    # Q8_0): "fma", float32 FMAs on the decoded weights (csrc/panel_linear.cpp); "bf16", bfloat16 dot products on the
    # integer codes (csrc/bf16_dot_linear.cpp, AVX-512 BF16: about 1.5-1.9x on an AMD Zen 4; many rows by FMAs with
    # the same bits where the CPU allows); "auto" takes bf16 where it measured faster at one row and not slower at 16
    # on this CPU (linear.py: bf16_dot_products_faster); "amx", the same dot products on AMX tiles (Intel Sapphire
    # Rapids and later), "auto"'s choice where they measured faster at 16 rows and at most 1.25x slower at one
    # (amx_tiles_faster). All round nothing before the float32 sums and keep batch invariance; they differ in float32
    # rounding only.
    block_dot_products: str = field(default="auto", metadata=flag(
        "with Q4_0/Q4_1/Q4_K/Q6_K/Q8_0 GGUF blocks and bfloat16 activations on the CPU: fma (float32 FMAs on decoded "
        "weights), bf16 (bfloat16 dot products on the integer codes, AVX-512 BF16) or amx (the same on AMX tiles, "
        "every row count, Intel Sapphire Rapids and later); auto takes bf16 where it measured faster at one row and "
        "not slower at 16 on this CPU, and amx over that where the tiles measured faster at 16 rows and at most "
        "1.25x slower at one", choices=BLOCK_DOT_PRODUCT_CHOICES))
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Model parallelism: ranks (processes) that split each layer, times stages that each run a share of the layers
    # (both: stages of tensor-parallel ranks); rank 0 schedules and samples.
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "split each layer over N processes (torch.distributed: gloo on CPU, NCCL on GPUs); the cores are shared "
        "among them"))
    pipeline_parallel_size: int = field(default=1, metadata=flag(
        "split the layers into N stages, one process each (torch.distributed)"))
    # A mixture-of-experts model under tensor parallelism: whole experts spread over the ranks (each holds its
    # share, every rank routes every token, one all-reduce combines), rather than every expert sliced over them.
    enable_expert_parallel: bool = field(default=False, metadata=flag(
        "mixture-of-experts models: place whole experts on the tensor-parallel ranks instead of slicing each"))
    # Model parallelism across machines: tcp://HOST:PORT where rank 0 waits for the ranks (HOST must be reachable
    # from the other machines); None: a free loopback port, every rank on this machine.
    dist_init_method: str | None = field(default=None, metadata=flag(
        "model parallelism across machines: where rank 0 waits for the ranks that other machines start with "
        "`serval rank` (HOST: this machine's address they reach); unset: every rank on this machine",
        metavar="tcp://HOST:PORT"))
    num_local_ranks: int | None = field(default=None, metadata=flag(  # rank 0 first
        "ranks this machine runs (rank 0 and the next ones; unset: all of them, or 1 with --dist-init-method)",
        name="--local-ranks"))
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    # The sampling defaults of requests that leave them out (model/sampling_defaults.py), as vLLM's flags: "auto",
    # the model's own (generation_config.json, GGUF general.sampling.*, else an embedded model's preset); "vllm",
    # none (OpenAI's: temperature 1.0, top_p 1.0); or a directory with a generation_config.json. The override
    # ({"temperature": 0.5, ...}) goes on top. A request's explicit values always win.
    generation_config: str = field(default=GENERATION_CONFIG_DEFAULT, metadata=flag(
        "sampling defaults for requests that leave temperature, top_p, top_k, min_p or repetition_penalty out: auto, "
        "the model's own (generation_config.json, GGUF general.sampling.*, or an embedded model's preset); vllm, "
        "none (OpenAI's: temperature 1); DIR, that folder's generation_config.json", metavar="auto|vllm|DIR"))
    override_generation_config: dict | None = field(default=None, metadata=flag(
        'sampling defaults on top of --generation-config, e.g. \'{"temperature": 0.5}\'', metavar="JSON",
        type=json_object))
    structured_outputs: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    # Decode-only steps on a GPU replay a CUDA graph per padded batch-size bucket (engine/cuda_graphs.py); on the CPU
    # a Llama or Gemma layer's kernels are one C++ call, and all the layers one (model/llama.py, use_cpu_layers).
    enforce_eager: bool = field(default=False, metadata=flag(
        "run every step eagerly: no CUDA graphs of decode steps on a GPU, and on the CPU each layer's kernels called "
        "one by one from Python"))
    # The CUDA-graph decode path's padding and persistent buffers on a CPU too, without capture: how the CPU suite
    # covers that path (no flag: a CPU step gains nothing from it).
    pad_decode_on_cpu: bool = False
    _settled = False  # made by settled() (not a dataclass field: a copy made by replace() is settled again)

    def __post_init__(self) -> None:
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("EngineConfig.generation_config must be 'auto', 'vllm' or a directory, "
                             f"got {self.generation_config!r}")
        if self.override_generation_config is not None:
            self.override_generation_config = check_sampling_defaults(self.override_generation_config,
                                                                      "EngineConfig.override_generation_config")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {value!r}")
        if self.dist_init_method is not None and not self.dist_init_method.startswith("tcp://"):
            raise ValueError(f"EngineConfig.dist_init_method must be tcp://HOST:PORT, got {self.dist_init_method!r}")
        if self.num_local_ranks is not None and not 1 <= self.num_local_ranks <= self.world_size:
            raise ValueError(f"EngineConfig.num_local_ranks must be 1 to {self.world_size} (the ranks), got "
                             f"{self.num_local_ranks!r}")
        if self.world_size > 1 and (self.speculative.method not in (None, "ngram") or self.cache.kv_offload_size):
            raise ValueError("model parallelism supports ngram speculation only (no draft model) and no KV "
                             "offload tier yet")
        if self.world_size > 1 and self.kv_transfer.role != "both":
            raise ValueError("a prefill or decode worker (--role) runs on one process: no model parallelism yet")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"EngineConfig.dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if not (self.device in ("cpu", "auto") or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.context_policy not in CONTEXT_POLICIES:
            raise ValueError("EngineConfig.context_policy must be 'error' or 'sliding_window', "
                             f"got {self.context_policy!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"EngineConfig.load_format must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"EngineConfig.quantization must be one of {list(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.activation_quantization not in ACTIVATION_QUANTIZATION_CHOICES:
            raise ValueError("EngineConfig.activation_quantization (--activation-quantization) must be one of "
                             f"{list(ACTIVATION_QUANTIZATION_CHOICES)}, got {self.activation_quantization!r}")
        if self.block_dot_products not in BLOCK_DOT_PRODUCT_CHOICES:
            raise ValueError("EngineConfig.block_dot_products (--block-dot-products) must be one of "
                             f"{list(BLOCK_DOT_PRODUCT_CHOICES)}, got {self.block_dot_products!r}")
        if self.scheduler.preemption_mode == "swap" and not self.cache.kv_offload_size:
            raise ValueError("preemption_mode 'swap' needs a second tier for the KV: set kv_offload_size "
                             "(--kv-offload-size GiB)")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"EngineConfig.max_model_len must be an integer >= 2, got {self.max_model_len!r}")

    def settled(self) -> EngineConfig:
        """This config with what it leaves to the hardware decided, as a new config: the device ("auto": cuda when
        torch sees a GPU, else cpu), the dtype ("auto": auto_dtype) and the sub-configs' fields left None (the
        device's defaults). The engine core settles the config it runs (EngineCore), in the process that imports
        torch: a server's process never does, and learns what it needs of the result from EngineCoreInfo."""
        if self._settled:
            return self
        import torch

        device = resolve_device(self.device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device is 'cuda' but torch sees no CUDA device")
        settled = replace(self, device=device, dtype=auto_dtype(device) if self.dtype == "auto" else self.dtype,
                          cache=self.cache.for_device(device), scheduler=self.scheduler.for_device(device),
                          speculative=self.speculative.for_device(device))
        settled._settled = True
        return settled

    @property
    def world_size(self) -> int:
        """Processes the model is split over."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        """The settled dtype's torch dtype (what the engine will compute in)."""
        import torch

        return getattr(torch, self.settled().dtype)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's element dtype: the model's, or the 8-bit code dtype of a quantized cache."""
        from serval.layers.attention import KV_CODE_DTYPES

        return KV_CODE_DTYPES.get(self.cache.kv_cache_dtype, self.torch_dtype)
