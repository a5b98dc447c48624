"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router scores the experts for each token, the top k of
them run on it, and their outputs are summed weighted by the router's probabilities.

The experts are computed grouped: the (token, slot) pairs are sorted by expert id, and each expert multiplies the
rows routed to it in one matmul (a loop over experts, never over tokens). Greedy output must not change with batch
composition, so each row's result may not depend on which other rows share its expert's matmul: where the CPU
kernels run, the experts' weights are laid out for their dense linear (layers/linear.py ``lay_out_for_cpu_kernels``),
which computes each row alone, so an expert multiplies exactly its routed rows, and the grouping and every expert
run in one C++ call (csrc/moe_experts.cpp: the loop's bits, without its dozen small aten calls a layer and several
per expert); elsewhere the expert matmuls are padded to the row count probed for their weight shape
(layers/linear.py ``row_padding``), as every Linear is.
The k weighted outputs of a token are then written to its own slots, never accumulated into a shared buffer, and
added in slot order: the sum is the same whichever expert (and, under expert parallelism, whichever rank) computed
each slot.

Expert parallelism: a rank holds the experts [start, end) only. Every rank sees every token (the hidden states are
replicated under tensor parallelism), routes them all, computes its own experts' slots and leaves the others zero;
one all-reduce (float32) of the slots gives every rank all of them — x + 0 is exact, so the combine is bitwise the
one-process result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serval.layers.activation import silu_and_mul
from serval.layers.linear import DENSE_KERNEL_DTYPES, Linear, dense_kernels, dense_matmul, padded_matmul, row_padding


class Experts(nn.Module):
    """``count`` SwiGLU experts stacked: gate_up_proj [count, 2 * intermediate, hidden] (gate rows first, then up, as
    transformers stores them fused) and down_proj [count, hidden, intermediate]."""

    def __init__(self, count: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(count, hidden_size, intermediate_size), requires_grad=False)
        self.min_rows: tuple[int, int] | None = None  # (gate_up, down) row paddings, probed on first use
        # The CPU kernels where both stacks are laid out for them: then SparseMoE runs all experts in one call of
        # theirs (csrc/moe_experts.cpp); found with min_rows
        self.kernels = None

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index``'s output for the rows x [n, hidden]."""
        if self.min_rows is None:
            self.probe_row_padding(x.dtype)
        gate_up, down = self.gate_up_proj[index], self.down_proj[index]
        h = padded_matmul(lambda rows: dense_matmul(rows, gate_up), x, self.min_rows[0])
        return padded_matmul(lambda rows: dense_matmul(rows, down), silu_and_mul(h), self.min_rows[1])

    def dense_weights(self) -> list[nn.Parameter]:
        """The stacks that layers/linear.py ``lay_out_for_cpu_kernels`` lays out for the CPU kernel."""
        return [self.gate_up_proj, self.down_proj]

    def probe_row_padding(self, dtype: torch.dtype) -> None:
        """The row paddings of the two matmuls' shapes: 1 where the CPU kernel multiplies them (each row alone),
        else probed with the keys of a dense Linear of the same shape: the matmul is the same F.linear on a
        contiguous [out, in] weight."""
        kernels = [dense_kernels(w[0]) for w in (self.gate_up_proj, self.down_proj)]
        self.kernels = kernels[0] if None not in kernels and dtype in DENSE_KERNEL_DTYPES else None
        if None not in kernels:
            self.min_rows = (1, 1)
            return
        device = self.gate_up_proj.device
        self.min_rows = tuple(
            row_padding(lambda rows, w=w: F.linear(rows, w), w.shape[1], ("dense", *w.shape), dtype, device)
            for w in (self.gate_up_proj[0], self.down_proj[0]))


class SparseMoE(nn.Module):
    """The MoE MLP of one layer: ``gate`` (the router, [num_experts, hidden]) and this rank's ``experts``.

    Routing as both families define it: a softmax over all experts' logits (in float32), the top ``top_k``, and
    those k weights divided by their sum if ``renormalize`` (always for Mixtral; Qwen3-MoE's ``norm_topk_prob``).
    The weights stay float32 and the weighted outputs are summed in float32, rounded to the model dtype once
    (transformers' Qwen3-MoE rounds the weights to the model dtype first: the same in float32, a rounding apart in
    bfloat16)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 local_experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.first_expert, self.end_expert = local_experts or (0, num_experts)
        self.gate = Linear(hidden_size, num_experts)
        self.experts = Experts(self.end_expert - self.first_expert, hidden_size, intermediate_size)
        self.group = None  # a ParallelGroup under expert parallelism (model/parallel.py): the slots are summed over it

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of the rows x [T, hidden]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, k = x.shape[0], self.top_k
        weights, ids = self.route(x)
        if self.experts.min_rows is None:
            self.experts.probe_row_padding(x.dtype)
        if (kernels := self.experts.kernels) is not None:
            # One C++ call for the grouping and every expert (csrc/moe_experts.cpp): the same bits as the loop below
            # (tests/layers/test_moe_experts.py).
            slots = kernels.moe_expert_slots(x, ids, weights, self.experts.gate_up_proj.transpose(1, 2),
                                             self.experts.down_proj.transpose(1, 2), self.first_expert)
        else:
            slots = self.grouped_slots(x, weights, ids)
        if self.group is not None:
            slots = self.group.all_reduce(slots)
        slots = slots.view(tokens, k, -1)
        if kernels is not None:
            return kernels.moe_sum_slots(slots, x)  # the lines below in one pass, the same bits
        total = slots[:, 0]
        for j in range(1, k):  # in slot order, elementwise: each row's sum alone
            total = total + slots[:, j]
        return total.to(x.dtype)

    def grouped_slots(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weighted outputs [T * k, hidden] float32 of this rank's experts per slot (zero for other ranks'), in
        PyTorch: a loop over the experts."""
        k = self.top_k
        flat = ids.flatten()  # slot s = token * k + j holds the token's j-th expert
        order = torch.argsort(flat, stable=True)  # the slots grouped by expert, in token order within each
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one device sync a layer
        # Gathered once in expert order, so that each expert's rows (and their weights) are a slice: no gather or
        # scatter per expert.
        rows, row_weights = x[order // k], weights.flatten()[order, None]
        outputs = torch.zeros(len(flat), x.shape[1], dtype=torch.float32, device=x.device)
        start = sum(counts[: self.first_expert])
        for expert in range(self.first_expert, self.end_expert):
            end = start + counts[expert]
            if end > start:
                out = self.experts(expert - self.first_expert, rows[start:end])
                torch.mul(out.float(), row_weights[start:end], out=outputs[start:end])
            start = end
        slots = torch.empty_like(outputs)
        slots[order] = outputs  # back to token order (slots of other ranks' experts stay zero)
        return slots
