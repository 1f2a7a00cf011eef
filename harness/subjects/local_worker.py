"""A driven engine's worker process (harness.subjects.process): python -m harness.subjects.local_worker SPEC FOLDER
[OPTIONS], OPTIONS a JSON object of LocalSubject's keyword arguments (device, serving)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict

from engine.core import SamplingParams
from harness.bench.arrivals import Trace
from harness.subjects.local import LocalSubject


def handle(subject: LocalSubject, req: Dict[str, Any]) -> Dict[str, Any]:
    op = req["op"]
    if op == "score":
        scored = subject.score(req["prompts"], req["max_new"], req["k"])
        return {"scored": [{"tokens": s.tokens,
                            "rows": [list(zip(i.tolist(), v.tolist())) for i, v in zip(s.ids, s.lp)]}
                           for s in scored]}
    if op == "sample":
        draws = subject.sample(req["prompt"], SamplingParams(**req["params"]), req["n"], req["seed"])
        return {"tokens": draws.tolist()}
    if op == "timed":
        return {"seconds": subject.timed(req["prompts"], req["max_new"])}
    if op == "serve":
        return {"timings": [asdict(t) for t in subject.serve(Trace.from_json(req["trace"]))]}
    return {"error": f"unknown op {op!r}"}


def main() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the engine prints goes to stderr, never into the answers
    sys.stdout = sys.stderr
    subject = LocalSubject(sys.argv[1], Path(sys.argv[2]), **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
    out.write(json.dumps({"ready": subject.provenance()}) + "\n")
    for line in sys.stdin:
        try:
            answer = handle(subject, json.loads(line))
        except Exception as e:  # the harness shows it; the worker stays up for the next request
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
    subject.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
