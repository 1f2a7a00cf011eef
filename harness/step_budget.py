"""How much prompt a step may carry beside the running decodes: the driver's per-step budget.

A step's cost is predicted by a linear model of what its forward computes (StepCost): fixed + per_token x tokens fed
+ per_row x requests (each gets a row of logits from the LM head) + per_pair x attention (query, key) pairs, where a
chunk of c tokens over a cached prefix of d adds c d + c (c + 1) / 2 pairs and a decode row at context L adds L.
Attention's share grows with the prefix depth, so one budget carries fewer tokens of a deep chunk than of a shallow
one (at 32k tokens of qwen3-0.6b a token's attention is about 8 times its matmuls).

A measured cost has a fifth term, per_key x the keys of the step's deepest extend: attention without a split of the
keys (FlashInfer's SM90 prefill gives each query tile of a head all its keys, on one SM) takes at least the time one
SM scans them, whatever the chunk's size. Measured on an H100 (qwen3-0.6b's attention, one layer, 32.5k cached keys):
64, 256 and 1024 query tokens each take 0.47-0.50 ms, against 0.07, 0.22 and 0.90 ms through FA2's paged prefill,
which splits the keys. So a step that carries a deep chunk costs at least its keys' floor (the budget cannot bound it
below that: docs/bench.md, Long prompts). from_config's FLOP counts leave it at 0.

Two budgets (StepBudget), both for the prompt work of a step that also decodes:
- tokens (the driver's default): at most the cost of `tokens` prompt tokens at depth 0, in the model's FLOP counts
  (StepCost.from_config): the same on every machine and deterministic, like vLLM's max_num_batched_tokens and SGLang's
  chunked_prefill_size, but following the depth.
- stall: the whole step costs at most `stall` times what its decodes alone cost, in seconds of a measured StepCost
  (harness.bench.step_cost fits one on the engine): a running request's next token waits at most that much longer
  because a prompt is arriving. In the model a prompt of W seconds of work then takes W stall / (stall - 1) to its
  first token, so the two promises trade: stall 3 keeps inter-token latency within 3x and costs the prompt 1.5x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.models import ModelConfig


def pairs(tokens: int, cached: int) -> int:
    """Attention (query, key) pairs of an extend of `tokens` over a cached prefix of `cached` tokens (causal)."""
    return tokens * cached + tokens * (tokens + 1) // 2


@dataclass(frozen=True)
class StepCost:
    """Predicted cost of one forward: fixed + per_token x tokens + per_row x requests + per_pair x pairs + per_key x
    the keys of its deepest extend (seconds when measured)."""

    fixed: float
    per_token: float
    per_row: float
    per_pair: float
    per_key: float = 0.0

    def __call__(self, tokens: int, rows: int, query_key_pairs: int, deepest: int = 0) -> float:
        return (self.fixed + self.per_token * tokens + self.per_row * rows + self.per_pair * query_key_pairs
                + self.per_key * deepest)

    def decodes(self, rows: int, kv_tokens: int) -> float:
        """A step of rows decodes attending over kv_tokens keys in all (the decode kernel splits the keys)."""
        return self(rows, rows, kv_tokens)

    def variable(self, tokens: int, cached: int) -> float:
        """What an extend of tokens over cached (one request) adds to a step that runs anyway."""
        return (self.per_token * tokens + self.per_row + self.per_pair * pairs(tokens, cached)
                + self.per_key * (cached + tokens))

    @classmethod
    def from_config(cls, mc: "ModelConfig") -> "StepCost":
        """The model's FLOP counts in units of one token's matmuls: a token 1, a row the LM head's, a pair
        attention's QK^T and PV over every layer (sliding layers counted as full: deep chunks get at most the
        budget they need)."""
        attn = 2 * mc.num_qo_heads * mc.head_dim * mc.hidden_size + 2 * mc.num_kv_heads * mc.head_dim * mc.hidden_size
        if mc.is_moe:
            mlp = sum(3 * mc.hidden_size * (mc.num_experts_per_tok * mc.moe_intermediate_size if moe else
                                            mc.intermediate_size) for moe in mc.moe_layers) / mc.num_layers
        else:
            mlp = 3 * mc.hidden_size * mc.intermediate_size
        token = 2 * mc.num_layers * (attn + mlp)
        return cls(0.0, 1.0, 2 * mc.vocab_size * mc.hidden_size / token, 4 * mc.num_layers * mc.num_qo_heads *
                   mc.head_dim / token)


@dataclass(frozen=True)
class StepBudget:
    cost: StepCost
    tokens: int | None = None  # the token budget (cost of this many prompt tokens at depth 0)
    stall: float | None = None  # the time budget: a step at most this many times its decodes' cost

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.stall is None):
            raise ValueError("a step budget is either tokens or stall")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"the token budget must be >= 1, got {self.tokens}")
        if self.stall is not None and not self.stall > 1:
            raise ValueError(f"stall must be > 1 (a step may cost that many times its decodes), got {self.stall}")

    def allowance(self, decode_rows: int, decode_pairs: int) -> float:
        """The cost the step's prompt work may add beside decode_rows decodes attending over decode_pairs keys."""
        if self.stall is not None:
            return (self.stall - 1.0) * self.cost.decodes(decode_rows, decode_pairs)
        return self.cost.variable(self.tokens, 0)

    def chunk(self, allowance: float, cached: int, most: int) -> int:
        """The longest extend over `cached` tokens, at most `most`, whose cost fits the allowance; at least one token
        (a prompt always advances, if by a step over the budget). The prefix's keys (per_key x cached), which no
        chunk of it avoids, are not charged to the allowance: charged, a chunk nearing the depth where they fill it
        would shrink to a few tokens a step (measured on an H100: 36 steps of 7 tokens at stall 2)."""
        fits = allowance + self.cost.per_key * cached  # what variable() may reach: the prefix's keys beside it
        a, b = self.cost.per_pair / 2, self.cost.per_token + self.cost.per_key + self.cost.per_pair * (cached + 0.5)
        left = allowance - self.cost.per_row  # the chunk's own row of logits
        if left <= 0:
            return 1
        n = left / b if a == 0 else (math.sqrt(b * b + 4 * a * left) - b) / (2 * a)
        n = max(1, min(most, int(n)))
        while n > 1 and self.cost.variable(n, cached) > fits:  # the root's rounding, either way
            n -= 1
        while n < most and self.cost.variable(n + 1, cached) <= fits:
            n += 1
        return n
