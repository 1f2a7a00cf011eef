"""Progress a person can follow, on a terminal and in a CI log alike: a line on stderr as each unit of work ends (a
model's path, a sampling case, a bench workload, a fuzzer configuration, a model prepared), with its verdict and the
seconds it took; tqdm bars only when stderr is a terminal, so that a log stays plain text (no carriage returns, no
escape codes)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterable

WHAT_WIDTH = 44  # the verdicts of one verb line up


def interactive() -> bool:
    """Whether stderr is a terminal, where bars redraw in place."""
    return sys.stderr.isatty()


def quiet_libraries() -> None:
    """Off a terminal, the bars of HF's libraries too (transformers' "Loading weights" and GGUF conversion,
    huggingface_hub's downloads): the environment reaches them when they are imported, here and in the processes
    this one starts."""
    if interactive():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # bars libraries draw with tqdm directly (transformers' GGUF loader)
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def bar(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """tqdm on stderr, drawn only on a terminal: every bar of the harness comes from here."""
    from tqdm import tqdm

    return tqdm(iterable, disable=not interactive(), **kwargs)


def line(verb: str, what: str, verdict: str, seconds: float) -> None:
    """`parity tiny-qwen3 cpu float32 batch  PASS  3.2 s`, between the bars of a terminal (tqdm.write clears and
    redraws them), flushed so that a log shows it as it happens."""
    from tqdm import tqdm

    tqdm.write(f"{verb} {what:<{WHAT_WIDTH}} {verdict:<9} {seconds:7.1f} s", file=sys.stderr)
    sys.stderr.flush()


class Stopwatch:
    """Seconds since it started, or since the last lap."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    def total(self) -> float:
        return time.perf_counter() - self.start
