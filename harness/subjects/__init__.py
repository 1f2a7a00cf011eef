"""The engine under test (--engine): what the harness needs of an engine, and the four kinds that provide it.

- `engine` (the default): this project's engine, driven by the harness's driver on every parity path.
- `python:MODULE:CLASS`: another implementation of the spec's Engine (ch06): built from an EngineConfig, with
  forward_batch(batch, args) -> ForwardOutput over the spec's Req and Batch, a `sampler` with prepare(batch), the page
  table and page count the driver fills, and shutdown(). The driver runs it on every path exactly as it runs this
  project's engine, so a reader's own implementation of the chapter meets the same gate.
- `vllm`: vLLM's Python API in a worker process of its own virtualenv (its pins and the harness's differ;
  harness.subjects.vllm says where the interpreter comes from).
- `openai:URL`: any OpenAI-compatible completions server (vLLM, SGLang, llama.cpp's server, TGI, `python -m harness
  serve`), through `prompt_logprobs` where the server has it, else `echo` with `logprobs`.

The first two are *driven*: the harness builds their batches. The other two are black boxes, seen through the
Subject interface (harness.subjects.base) only: teacher-forced top-K log-probabilities at every position, greedy
generation, N draws of the next token, timed generation. A driven engine offers the same interface
(harness.subjects.local), so the sampling grid and the bench treat all four alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from harness.subjects.spec import (KINDS, OWN, check, driven, engine_class, kind, name,  # noqa: F401 (the API)
                                   named, report_dir, suffix)

if TYPE_CHECKING:
    from harness.models import ModelRef
    from harness.subjects.base import Subject


def open_subject(spec: str, model: "ModelRef | str", own_process: bool = False,
                 serving: "Dict[str, Any] | None" = None, device: str = "cpu") -> "Subject":
    """The Subject --engine names, serving `model` (the caller closes it); own_process: a driven engine in a worker
    process (a black box is always outside this one). serving: an engine sized for a serving trace (max_seq_len,
    slots; stall: the step budget over a cost model measured first, cost_depth deep), on device."""
    from harness.models import as_model

    folder = as_model(model).folder
    k = kind(spec)
    if k == "vllm":
        from harness.subjects.vllm import VllmSubject

        return VllmSubject(folder, serving)
    if k == "openai":
        from harness.subjects.openai import OpenAISubject

        return OpenAISubject(spec.partition(":")[2], folder)
    options = {"device": device, "serving": serving} if serving else {"device": device}
    if own_process:
        import json
        import os
        import sys

        from harness.subjects.local import LocalSubject
        from harness.subjects.process import ProcessSubject

        return ProcessSubject([sys.executable, "-m", "harness.subjects.local_worker", spec, str(folder),
                               json.dumps(options)], dict(os.environ), LocalSubject.top_k)
    from harness.subjects.local import LocalSubject

    return LocalSubject(spec, folder, **options)
