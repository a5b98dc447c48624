"""The attention backends' one selection point: which backend select_backend picks, that the metadata it builds
carries a backend that runs on another rank, and (from the source) that the choice and the kernels-available check
are each made in one place."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch

from serval.layers import cpu_kernels
from serval.layers.attention import AttentionBackend, ScheduledSequence, paged_attention, select_backend
from serval.layers.attention.cpu_kernel import CpuKernelBackend, CpuKernelMetadata
from serval.layers.attention.torch_reference import TorchReferenceBackend, TorchReferenceMetadata

PACKAGE = Path(__file__).resolve().parents[2] / "serval"
BLOCK, KV_HEADS, HEADS, DIM = 16, 2, 4, 64
SEQS = [ScheduledSequence([3, 0], 20, 1), ScheduledSequence([1, 2, 4], 30, 9)]  # a decode, then a 9-token chunk


@pytest.fixture
def kernels_off(monkeypatch):
    """SERVAL_CPU_KERNELS=0, as a process started with it sees it (the loaded module forgotten)."""
    monkeypatch.setenv("SERVAL_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})


def test_select_backend_takes_the_cpu_kernel_on_a_cpu_that_builds_it():
    if cpu_kernels.load() is None:
        pytest.skip("the C++ kernels could not be built here")
    backend = select_backend("cpu", torch.bfloat16, BLOCK)
    assert isinstance(backend, CpuKernelBackend) and backend.kernels is cpu_kernels.load()
    meta = backend.build_metadata(SEQS)
    assert isinstance(meta, CpuKernelMetadata) and meta.backend is backend
    assert meta.token_table.tolist() == [0] + [1] * 9 and meta.context_lens.tolist() == [21] + list(range(31, 40))
    assert meta.block_tables.tolist() == [[3, 0, 0], [1, 2, 4]]


def test_select_backend_takes_the_pytorch_reference_with_the_kernels_off(kernels_off):
    backend = select_backend("cpu", torch.bfloat16, BLOCK)
    assert cpu_kernels.load() is None and isinstance(backend, TorchReferenceBackend)
    meta = backend.build_metadata(SEQS)
    assert isinstance(meta, TorchReferenceMetadata) and meta.backend is backend
    assert meta.num_decode_tokens == 1 and meta.decode_block_tables.tolist() == [[3, 0]]
    assert [(c.query_start, c.query_len, c.seq_len, c.block_table.tolist()) for c in meta.prefills] == [
        (1, 9, 39, [1, 2, 4])]
    assert meta.slot_mapping.tolist() == [0 * BLOCK + 4] + [2 * BLOCK + p - BLOCK for p in range(30, 32)] + [
        4 * BLOCK + p - 2 * BLOCK for p in range(32, 39)]


def test_select_backend_takes_the_pytorch_reference_off_the_cpu_without_loading_the_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: pytest.fail("a CUDA runner asked for the CPU kernels"))
    # (a cache of the model's dtype on CUDA takes the Triton kernel: tests/layers/test_triton_attention.py)
    assert type(select_backend(torch.device("cuda", 0), torch.int8, BLOCK)) is TorchReferenceBackend


def test_the_reference_refuses_a_batch_whose_decodes_do_not_come_first():
    with pytest.raises(ValueError, match="one-token sequences come before"):
        TorchReferenceBackend("cpu", torch.float32, BLOCK).build_metadata(SEQS[::-1])


@pytest.mark.parametrize("backend_kind", ["cpu_kernel", "torch_reference"])
@torch.inference_mode()
def test_metadata_sent_to_another_rank_runs_there_as_here(backend_kind):
    """Rank 0 broadcasts each step's metadata pickled (serval/distributed.py); the backend it carries comes back
    able to run, with the same result."""
    backend = select_backend("cpu", torch.float32, BLOCK)
    if backend_kind == "torch_reference":
        backend = TorchReferenceBackend("cpu", torch.float32, BLOCK)
    elif not isinstance(backend, CpuKernelBackend):
        pytest.skip("the C++ kernels could not be built here")
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, BLOCK, KV_HEADS, DIM, generator=gen)
    q, k, v = (torch.randn(10, n, DIM, generator=gen) for n in (HEADS, KV_HEADS, KV_HEADS))
    meta = backend.build_metadata(SEQS)
    received = pickle.loads(pickle.dumps(meta))
    assert type(received.backend) is type(backend) and received.backend is not backend
    want = paged_attention(q, k, v, *cache.clone(), meta, DIM**-0.5)
    assert torch.equal(paged_attention(q, k, v, *cache.clone(), received, DIM**-0.5), want)


# --- from the source: one kernels-available check, one choice of backend ---


def _sources() -> dict[str, ast.Module]:
    return {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _attribute_uses(tree: ast.Module, owner: str) -> set[str]:
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == owner}


def test_only_for_device_says_whether_the_cpu_kernels_run():
    """Every module outside cpu_kernels.py asks ``cpu_kernels.for_device``; none loads the kernels or reads
    SERVAL_CPU_KERNELS itself."""
    askers, others = [], {}
    for name, tree in _sources().items():
        if name == "layers/cpu_kernels.py":
            continue
        uses = _attribute_uses(tree, "cpu_kernels")
        if uses:
            askers.append(name)
        if uses - {"for_device"}:
            others[name] = uses - {"for_device"}
        assert not any(isinstance(n, ast.Constant) and n.value == "SERVAL_CPU_KERNELS" for n in ast.walk(tree)), name
    assert others == {}
    assert "layers/attention/selector.py" in askers and "layers/linear.py" in askers  # (the check is found at all)


def test_only_the_selector_chooses_an_attention_backend():
    """Outside its own module, a backend class is built only in selector.py; select_backend is called by the runner
    alone, once; and the runner never looks at the device type to pick a path."""
    backends = {cls.__name__: cls.__module__ for cls in AttentionBackend.__subclasses__()}
    assert set(backends) >= {"CpuKernelBackend", "TorchReferenceBackend"}
    built_in, selected_in = [], []
    for name, tree in _sources().items():
        module = "serval." + name.removesuffix(".py").replace("/", ".")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if called in backends and backends[called] != module:
                built_in.append(name)
            if called == "select_backend":
                selected_in.append(name)
    assert set(built_in) == {"layers/attention/selector.py"}
    assert selected_in == ["engine/runner.py"]
    runner = _sources()["engine/runner.py"]
    assert not [n for n in ast.walk(runner) if isinstance(n, ast.Attribute) and n.attr == "type"]
    names = {n.id for n in ast.walk(runner) if isinstance(n, ast.Name)}
    assert not set(backends) & names
