"""Vocabulary-parallel embedding and LM head: rank r owns vocab rows [r*V/tp, (r+1)*V/tp)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replicas.distributed.parallel_state import get_tp_group
from replicas.kernels import quant_cpu
from replicas.layers.quantized_linear import QuantizedWeight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = get_tp_group()       # bound at construction: several engines may share a process
        tp = self.tp.world_size
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + tp - 1) // tp
        self.vocab_start = self.tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        part = loaded[self.vocab_start: self.vocab_start + self.shard_size]
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        valid = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * valid.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(y)


def float_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [S, H] @ weight.T in float32. On CUDA 16-bit operands go through one GEMM that accumulates and writes
    float32: rounded to bf16, logits of typical magnitude step by 0.125, so the same rows multiplied in two GEMM
    shapes (a verify step's tree rows against a decode step's one row) could swap a greedy pick between two
    tokens two such steps apart."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and hidden.dim() == 2:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden, weight).float()


class ParallelLMHead(VocabParallelEmbedding):
    """Float32 logits for the last hidden state of each sampled sequence; full vocab on rank 0 only. With a
    quantized checkpoint on the CPU (`keep_quantized`), batches of up to quant_cpu.MAX_ROWS rows multiply the
    quantized shard, larger ones the float weight."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.quantized: QuantizedWeight | None = None

    def keep_quantized(self, loaded: QuantizedWeight) -> None:
        """Keep this rank's rows of the quantized [vocab, hidden] checkpoint matrix (rows past the vocabulary zero,
        as in the float shard)."""
        rows = min(self.shard_size, loaded.shape[0] - self.vocab_start)
        shard = QuantizedWeight.empty(self.shard_size, loaded.shape[1], loaded.bits)
        for t in (shard.q, shard.scale, shard.zero):
            if t is not None:
                t.zero_()
        shard.narrow(0, 0, rows).copy_(loaded.narrow(0, self.vocab_start, rows))
        self.quantized = shard

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.quantized is not None and hidden.shape[0] <= quant_cpu.MAX_ROWS:
            logits = self.quantized.linear(hidden, None).float()
        else:
            logits = float_logits(hidden, self.weight)
        if self.tp.world_size == 1:
            return logits
        full = self.tp.gather_to_first(logits, dim=-1)
        return None if full is None else full[..., : self.vocab_size]
