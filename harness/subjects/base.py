"""What the harness needs of an engine under test, whatever it is: the Subject interface.

Positions are absolute, as the goldens count them: the row at position p is the distribution that predicts token p +
1 of the sequence. `score` greedy-generates max_new tokens after each prompt and returns the top-K log-probabilities
at every position from the prompt's first to the last generated token's predecessor (len(prompt) + max_new - 1 rows):
with max_new 1 on a prompt followed by its golden continuation but the last token, that is the teacher-forced row of
every golden position.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import numpy as np

from engine.core import SamplingParams
from harness import UserError
from harness.bench.arrivals import Timing, Trace

MIN_TOP_K = 20  # the fewest log-probabilities per position a subject must return (vLLM's default max_logprobs)


class Unsupported(UserError):
    """What a subject cannot do (a top-K below MIN_TOP_K, no seed, a sampling parameter it lacks): one line; the
    check that needs it is left out and what can run runs."""


@dataclass
class Scored:
    """One sequence as a subject scored it."""

    tokens: List[int]  # the tokens it generated (greedy)
    ids: np.ndarray  # [positions, k] int64, each row by descending log-probability; -1 where it gave fewer
    lp: np.ndarray  # [positions, k] float64 log-probabilities; -inf where it gave fewer


def rows(pairs: Sequence[Sequence[tuple]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per position a list of (token id, logprob) -> the (ids, lp) arrays of a Scored, sorted, padded to k."""
    ids = np.full((len(pairs), k), -1, dtype=np.int64)
    lp = np.full((len(pairs), k), -np.inf)
    for i, row in enumerate(pairs):
        top = sorted(row, key=lambda t: -t[1])[:k]
        ids[i, :len(top)] = [t[0] for t in top]
        lp[i, :len(top)] = [t[1] for t in top]
    return ids, lp


class Subject(ABC):
    """An engine under test. seeded: whether sample() reproduces its draws from a seed."""

    top_k: int = MIN_TOP_K  # the log-probabilities per position it returns
    seeded: bool = True
    # the sampling parameters it takes beyond temperature (the grid leaves out a case that needs another)
    parameters: frozenset = frozenset({"top_k", "top_p", "min_p"})

    @abstractmethod
    def provenance(self) -> Dict[str, Any]:
        """What it is: kind, version, model (by name: reports hold no machine's paths); in every report about it."""

    @abstractmethod
    def score(self, prompts: Sequence[List[int]], max_new: Sequence[int], k: int) -> List[Scored]:
        """Greedy generation of max_new[i] tokens after prompts[i] (never stopping early at EOS) and the top-k
        log-probabilities at every position (module docstring); all prompts at once, as one batch where it can."""

    @abstractmethod
    def sample(self, prompt: List[int], params: SamplingParams, n: int, seed: int) -> np.ndarray:
        """n independent draws [n] int64 of the token after prompt under params, with the engine's own sampler."""

    @abstractmethod
    def timed(self, prompts: Sequence[List[int]], max_new: int) -> float:
        """Seconds to generate max_new tokens greedily after every prompt at once (never stopping at EOS)."""

    @abstractmethod
    def serve(self, trace: Trace) -> List[Timing]:
        """Replay the trace: each request sent at its arrival (under the trace's concurrency cap), greedy, exactly
        its output_len tokens (never stopping at EOS), each chunk of tokens timed as it arrives; a request that
        failed carries its error."""

    def close(self) -> None:
        """Stop what it started (a worker process, an engine)."""

    def __enter__(self) -> "Subject":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_top_k(subject: Subject, spec: str) -> None:
    if subject.top_k < MIN_TOP_K:
        raise Unsupported(f"--engine {spec} returns {subject.top_k} log-probabilities per position; parity needs "
                          f"at least {MIN_TOP_K} (raise its max_logprobs)")
