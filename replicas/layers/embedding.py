"""Vocabulary-parallel embedding and LM head: rank r owns vocab rows [r*V/tp, (r+1)*V/tp)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replicas.distributed.parallel_state import get_tp_group


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


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the last hidden state of each sampled sequence; full vocab on rank 0 only."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        if self.tp.world_size == 1:
            return logits
        full = self.tp.gather_to_first(logits, dim=-1)
        return None if full is None else full[..., : self.vocab_size]
