"""Vocab-parallel embedding and LM head. Each rank owns ceil(V / tp) rows; the last rank's tail is padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_info, tp_all_gather_last_dim, tp_all_reduce
from engine.layers.ops import TorchOps


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first row, rows per rank) of this rank's slice of the vocabulary."""
    info = get_tp_info()
    per_rank = -(-vocab_size // info.size)
    return info.rank * per_rank, per_rank


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, rows = vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(nn.Module):
    """An untied LM head's weight; a tied model computes its logits from the embedding's weight instead."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_shard(vocab_size)[1], hidden_size), requires_grad=False)


def compute_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, ops: TorchOps) -> torch.Tensor:
    """hidden [N, H] -> logits [N, vocab_size], gathered over ranks with the padding rows cut off."""
    return tp_all_gather_last_dim(ops.lm_head(hidden, weight))[:, :vocab_size]
