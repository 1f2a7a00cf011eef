"""`--engine vllm`: vLLM's Python API in a worker process (harness.subjects.vllm_worker) run by vLLM's own
interpreter: HARNESS_VLLM_PYTHON if set, else .peers/vllm/bin/python, the virtualenv `nox -s peer-vllm` builds."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

from harness import UserError
from harness.report import REPO_ROOT
from harness.subjects.process import ProcessSubject
from harness.subjects.vllm_worker import MAX_LOGPROBS

# vLLM's CPU build reserves a core for its API process by default; on the bench's cores both engines compute on all
# of them (either setting may be overridden from the environment)
WORKER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
VENV_PYTHON = REPO_ROOT / ".peers" / "vllm" / "bin" / "python"


def interpreter() -> Path:
    python = Path(os.environ.get("HARNESS_VLLM_PYTHON", VENV_PYTHON))
    if not python.exists():
        raise UserError(f"--engine vllm: no vLLM interpreter at {python}; build it with `nox -s peer-vllm` (vLLM's "
                        f"CPU build in a virtualenv of its own), or point HARNESS_VLLM_PYTHON at one")
    return python


class VllmSubject(ProcessSubject):
    def __init__(self, folder: Path, serving: Dict[str, Any] | None = None) -> None:
        """serving: vLLM's async engine sized for a serving trace (max_seq_len, slots), answering serve only."""
        python = interpreter()
        print(f"vllm: starting {python} on {folder} (loading the model takes about 30 s)", file=sys.stderr,
              flush=True)
        worker = Path(__file__).with_name("vllm_worker.py")
        extra = [json.dumps({k: serving[k] for k in ("max_seq_len", "slots")})] if serving else []
        # -P: the worker's folder stays off sys.path (its vllm.py and openai.py are not the packages vLLM imports)
        super().__init__([str(python), "-P", str(worker), str(folder), *extra],
                         {**WORKER_ENV, **os.environ, "PYTHONPATH": ""}, MAX_LOGPROBS)
