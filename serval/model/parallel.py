"""Model parallelism for the Llama family. Tensor parallelism: each rank holds a slice of every layer and the ranks
sum their parts. Pipeline parallelism (``PipelineStage``, at the end): each rank holds a run of whole layers.

- Attention: whole key/value heads per rank, each with its group of query heads (9 heads and 3 KV heads over 2
  ranks: 6+2 on rank 0, 3+1 on rank 1); q/k/v rows and o_proj columns sliced to match. Each rank's KV cache holds
  only its KV heads. o_proj's outputs are partial sums: one all-reduce.
- MLP: gate/up rows and down columns sliced (the SiLU-gated product is per column, so no exchange between them);
  down's outputs are partial sums: one all-reduce.
- Mixture-of-experts layers (layers/moe.py): every rank routes every token (the hidden states are whole on every
  rank). Each expert is sliced as the MLP is (its gate/up rows and down columns), or, with expert parallelism, the
  experts are spread whole over the ranks (rank r holds its ``partition`` of them); either way each rank's share of
  every token's expert slots is summed over the ranks in one float32 all-reduce.
- The head is vocabulary-parallel: each rank scores a slice of the vocabulary and the slices are gathered, so the
  sampler on rank 0 sees every logit. The embedding stays whole on every rank (a lookup, no compute to split).

The model classes stay as they are: a rank builds the model of its local shape (``local_config``), loads the slices
of the checkpoint's tensors (``shard_weights``), and wraps the layers whose outputs need a collective
(``parallelize``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from serval.distributed import ParallelGroup, partition
from serval.layers.embedding import embedding_dtype
from serval.layers.linear import BlockWeight
from serval.layers.moe import SparseMoE
from serval.model.config import ModelConfig

WeightLike = torch.Tensor | BlockWeight


# The families whose layers these splits know (the Llama decoder, with or without experts).
PARALLEL_ARCHITECTURES = ("llama", "mixtral", "qwen3_moe")


def _check_split(cfg: ModelConfig, kind: str, parts: int, available: int, what: str) -> None:
    if cfg.architecture not in PARALLEL_ARCHITECTURES:
        raise ValueError(f"{kind} parallelism supports {', '.join(PARALLEL_ARCHITECTURES)}, not {cfg.architecture}")
    if parts > available:
        raise ValueError(f"{kind}_parallel_size {parts} is more than the model's {available} {what}")


def _take(weight: WeightLike, rows: slice, columns: slice) -> WeightLike | None:
    if isinstance(weight, BlockWeight):
        try:
            return weight.slice(rows, columns)
        except ValueError:
            return None
    return weight[rows, columns]


@dataclasses.dataclass
class TensorParallelShard:
    """What rank ``rank`` of ``world_size`` holds of a model of shape ``config``; ``expert_parallel``: whole experts
    (a share of them), else a slice of every expert."""

    config: ModelConfig
    rank: int
    world_size: int
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        cfg = self.config
        _check_split(cfg, "tensor", self.world_size, cfg.num_kv_heads, "key/value heads")
        group = cfg.num_heads // cfg.num_kv_heads
        self.kv_heads = partition(cfg.num_kv_heads, self.world_size, self.rank)
        self.q_heads = (self.kv_heads[0] * group, self.kv_heads[1] * group)
        self.intermediate = partition(cfg.intermediate_size, self.world_size, self.rank)
        self.vocab = partition(cfg.vocab_size, self.world_size, self.rank)
        self.experts = (0, cfg.num_experts)
        self.expert_intermediate = (0, cfg.moe_intermediate_size)
        if self.expert_parallel:
            _check_split(cfg, "expert", self.world_size, cfg.num_experts, "experts")
            self.experts = partition(cfg.num_experts, self.world_size, self.rank)
        elif cfg.moe_layers:
            self.expert_intermediate = partition(cfg.moe_intermediate_size, self.world_size, self.rank)
        self.vocab_sizes = [end - start for start, end in
                            (partition(cfg.vocab_size, self.world_size, r) for r in range(self.world_size))]

    def local_config(self) -> ModelConfig:
        """The model shape this rank builds (the head is replaced after: see ``build``)."""
        cfg = self.config
        return dataclasses.replace(cfg, num_heads=self.q_heads[1] - self.q_heads[0],
                                   num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                                   intermediate_size=self.intermediate[1] - self.intermediate[0],
                                   moe_intermediate_size=self.expert_intermediate[1] - self.expert_intermediate[0],
                                   local_experts=self.experts if cfg.moe_layers else None,
                                   tie_word_embeddings=False)

    def build(self, model_cls) -> nn.Module:
        """The rank's model, on whatever device is current (meta while loading): local shapes, its head's slice."""
        model = model_cls(self.local_config())
        model.lm_head = type(model.lm_head)(self.config.hidden_size, self.vocab[1] - self.vocab[0])
        return model

    def shard_weights(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """Hugging Face-named full weights (tensors, or a GGUF file's BlockWeights) -> this rank's slices, under the
        same names. A tied head is the embedding's rows of this rank's vocabulary slice. A BlockWeight whose slice
        would cut its blocks is left out (that linear then stays dense: load_model loads dense weights first)."""
        cfg, hd = self.config, self.config.head_dim
        q = slice(self.q_heads[0] * hd, self.q_heads[1] * hd)
        kv = slice(self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        inter, vocab, whole = slice(*self.intermediate), slice(*self.vocab), slice(None)
        by_kind = {"q_proj": (q, whole), "k_proj": (kv, whole), "v_proj": (kv, whole), "o_proj": (whole, q),
                   "gate_proj": (inter, whole), "up_proj": (inter, whole), "down_proj": (whole, inter)}
        expert_inter = slice(*self.expert_intermediate)
        by_expert_kind = {"gate_proj": (expert_inter, whole), "up_proj": (expert_inter, whole),
                          "down_proj": (whole, expert_inter)}
        for name, weight in weights:
            kind = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            bare = name.removeprefix("model.")
            if ".experts." in name:  # layers.L.mlp.experts.E.gate_proj.weight
                expert = int(name.split(".experts.")[1].split(".")[0])
                if self.experts[0] <= expert < self.experts[1]:
                    yield name, weight if self.expert_parallel else _take(weight, *by_expert_kind[kind])
            elif kind in by_kind:
                cut = _take(weight, *by_kind[kind])
                if cut is not None:
                    yield name, cut
            elif bare == "lm_head.weight" or (bare == "embed_tokens.weight" and cfg.tie_word_embeddings):
                cut = _take(weight, vocab, whole)
                if cut is not None:
                    yield "lm_head.weight", cut
                if bare == "embed_tokens.weight" and isinstance(weight, torch.Tensor):
                    yield name, weight  # the embedding itself stays whole
            else:
                yield name, weight

    def parallelize(self, model: nn.Module, group: ParallelGroup) -> nn.Module:
        """Wraps the layers whose outputs are partial (o_proj, down_proj, the experts' slots: all-reduce) or sliced
        (the head: gather)."""
        for layer in model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.group = group
            for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
                if not hasattr(parent, name):  # a SparseMoE: summed above
                    continue
                linear = getattr(parent, name)
                # Block-format linears can hand over their float32 sums: the partial products then meet unrounded
                # and the total rounds to the model dtype once, as the single-process product does.
                if hasattr(linear, "float_output"):
                    linear.float_output = True
                setattr(parent, name, AllReduced(linear, group))
        model.lm_head = VocabGathered(model.lm_head, group, self.vocab_sizes)
        return model


class AllReduced(nn.Module):
    """A row-parallel linear: each rank's product over its input slice, summed over ranks."""

    def __init__(self, linear: nn.Module, group: ParallelGroup) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x)).to(x.dtype)


class VocabGathered(nn.Module):
    """A vocabulary-parallel head: each rank's logits slice, joined in rank order."""

    def __init__(self, linear: nn.Module, group: ParallelGroup, sizes: list[int]) -> None:
        super().__init__()
        self.linear, self.group, self.sizes = linear, group, sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.linear(x), self.sizes)


class PipelineStage(nn.Module):
    """Stage s of N runs layers [start, end) of the model, in order: stage 0 embeds the tokens, each stage passes
    the hidden states and the residual stream to the next, and the last hands them back to stage 0, which holds the
    final norm and the head (the sampler is on rank 0). With tensor parallelism too, each of a stage's ranks holds
    its slice of the stage's layers and exchanges with the rank of the same slice in the stages before and after.
    ``pipelined`` runs a step as micro-batches, so that while one stage computes a micro-batch the stage before it
    computes the next one. ``config`` is the stage's (its own layers: its KV cache holds only theirs)."""

    def __init__(self, model: nn.Module, group: ParallelGroup) -> None:
        super().__init__()
        cfg = model.config
        _check_split(cfg, "pipeline", group.num_stages, cfg.num_layers, "layers")
        self.start, self.end = partition(cfg.num_layers, group.num_stages, group.stage)
        self.group = group
        model.layers = nn.ModuleList(list(model.layers)[self.start: self.end])
        self.model = model
        self.config = dataclasses.replace(cfg, num_layers=self.end - self.start)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta) -> torch.Tensor:
        model, group = self.model, self.group
        stage, last = group.stage, group.num_stages - 1
        shape = (2, input_ids.shape[0], self.config.hidden_size)  # the hidden states and the residual stream
        dtype = embedding_dtype(model.embed_tokens)
        if stage == 0:
            x, residual = model.embed_tokens(input_ids), None
        else:
            x, residual = group.recv(shape, dtype, group.rank_in_stage(stage - 1)).unbind(0)
        rope = model.rotary.for_step(positions, dtype)
        for layer, kv_cache in zip(model.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        group.send(torch.stack([x, residual]), group.rank_in_stage(stage + 1))  # the last stage sends to stage 0
        if stage != 0:
            return x  # not used: stage 0 scores
        x, residual = group.recv(shape, dtype, group.rank_in_stage(last)).unbind(0)
        return model.norm(x, residual)[0]

    def pipelined(self, batches: list[tuple[torch.Tensor, torch.Tensor, object]], kv_caches: torch.Tensor):
        """Runs micro-batches (input ids, positions, attention metadata) through the stages; stage 0 yields each
        one's final hidden states in order, once it is back (the caller scores it while the later stages still
        compute the next one); other stages yield nothing. Sends do not wait: a stage goes on to its next
        micro-batch while the one after it takes the last."""
        model, group = self.model, self.group
        stage, last = group.stage, group.num_stages - 1
        dtype = embedding_dtype(model.embed_tokens)
        shapes = [(2, ids.shape[0], self.config.hidden_size) for ids, _, _ in batches]
        sends = []  # (work, the tensor it sends): kept alive until the send completes

        def run(x, residual, positions, meta):
            rope = model.rotary.for_step(positions, dtype)
            for layer, kv_cache in zip(model.layers, kv_caches):
                x, residual = layer(rope, x, residual, kv_cache, meta)
            out = torch.stack([x, residual])
            sends.append((group.isend(out, group.rank_in_stage(stage + 1)), out))

        try:
            if stage == 0:
                for ids, positions, meta in batches:
                    run(model.embed_tokens(ids), None, positions, meta)
                for shape in shapes:
                    x, residual = group.recv(shape, dtype, group.rank_in_stage(last)).unbind(0)
                    yield model.norm(x, residual)[0]
            else:
                for shape, (_, positions, meta) in zip(shapes, batches):
                    run(*group.recv(shape, dtype, group.rank_in_stage(stage - 1)).unbind(0), positions, meta)
        finally:
            for work, _ in sends:
                work.wait()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Stage 0's ranks score (with tensor parallelism, each its slice of the vocabulary, gathered)."""
        return self.model.compute_logits(hidden) if self.group.stage == 0 else None
