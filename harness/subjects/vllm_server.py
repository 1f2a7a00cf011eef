"""vLLM's own OpenAI-compatible server, run by the peer virtualenv's interpreter: the `openai:` door against a server
no one here wrote (`nox -s peer-vllm` gates it beside vLLM's Python API, harness.subjects.vllm).

It runs as a user runs `vllm serve`, with what the goldens need: fp32, max_logprobs 64 (the goldens' top-K), eager (no
graph capture on a CPU), max_model_len 4096, seed 0, on this host's cores (harness.subjects.vllm.WORKER_ENV); prefix
caching stays on, vLLM's default (the bench gives every timed call prompts of its own). Its log goes to LOG.

    python -m harness.subjects.vllm_server [--model NAME] [--port N] [ARGS...]

starts it on the model (default smollm2-135m), runs parity, sampling and bench through `--engine openai:URL` with
ARGS (e.g. --update-reports) and stops it; the exit status is the worst of the three.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

from harness import EXIT_USER_ERROR, UserError
from harness.report import REPO_ROOT
from harness.subjects.vllm import WORKER_ENV, interpreter
from harness.subjects.vllm_worker import MAX_LOGPROBS

LOG = REPO_ROOT / "build" / "peers" / "vllm-server.log"
PORT = 8765  # fixed, so that the reports' folder (reports/peers/openai-http-127.0.0.1-8765/) stays the same
START_TIMEOUT = 600.0  # seconds: loading and warming up on 2 CPU cores takes about 60


def command_line(folder: Path, port: int) -> List[str]:
    return [str(interpreter()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-logprobs", str(MAX_LOGPROBS),
            "--enforce-eager", "--max-model-len", "4096", "--seed", "0"]


@contextmanager
def served(folder: Path, port: int = PORT) -> Iterator[str]:
    """vLLM's server on the model folder, up and answering; yields its URL, stops it afterwards."""
    LOG.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with open(LOG, "w") as log:
        proc = subprocess.Popen(command_line(folder, port), stdout=log, stderr=subprocess.STDOUT,
                                env={**WORKER_ENV, **os.environ, "PYTHONPATH": ""})
        try:
            _wait(proc, url)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = LOG.read_text().strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"vLLM's server ended (exit {proc.returncode}) before it answered: {tail[0]}; its log: "
                            f"{LOG}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(2)
    raise UserError(f"vLLM's server did not answer at {url} within {START_TIMEOUT:.0f} s; its log: {LOG}")


def main(argv: List[str]) -> int:
    from harness.__main__ import main as harness
    from harness.models import zoo_model

    p = argparse.ArgumentParser(prog="python -m harness.subjects.vllm_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the zoo model it serves (default smollm2-135m)")
    p.add_argument("--port", type=int, default=PORT)
    args, rest = p.parse_known_args(argv)
    statuses = []
    try:
        with served(zoo_model(args.model).folder, args.port) as url:
            engine = ["--engine", f"openai:{url}"]
            for verb in (["parity", "--model", args.model, "--no-sampling"], ["sampling", "--real-model", args.model],
                         ["bench", "--model", args.model]):
                statuses.append(harness(verb + engine + rest))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return max(statuses)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
