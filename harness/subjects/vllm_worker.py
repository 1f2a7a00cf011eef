"""vLLM's side of `--engine vllm`: run by vLLM's own interpreter (`python vllm_worker.py MODEL_FOLDER [SERVING]`), it
imports the standard library and vllm only, never the harness (whose pins differ from vLLM's).

One JSON object a line on stdin, its answer a line on the stdout it started with (everything vLLM prints goes to
stderr): {"op": "score" | "sample" | "timed" | "info", ...} -> the result, or {"error": "..."}. The first line it
writes is {"ready": ...} once the model has loaded. fp32, eager (no graph capture), no prefix caching: every request
computes its whole prompt, as the goldens' HF run does.

SERVING (a JSON object: max_seq_len, slots) starts vLLM's async engine instead (AsyncLLM, what its OpenAI server
runs), which answers {"op": "serve", "trace": ...}: the trace's requests sent at their arrivals (an asyncio task each,
a semaphore for a concurrency cap, as `vllm bench serve` sends them), each streamed output timed as it comes, in the
harness's Timing layout (harness/bench/arrivals.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List

MAX_LOGPROBS = 64  # the goldens keep HF's top-64 at every position


def _rows(per_position: List[Any], k: int) -> List[List[List[float]]]:
    """vLLM's {token id: Logprob} per position -> [[id, logprob], ...] of its top-k (the prompt token it adds beside
    them, ranked lower, is left out so that a row is exactly the top-k)."""
    return [[[int(t), float(lp.logprob)] for t, lp in row.items() if lp.rank is not None and lp.rank <= k]
            for row in per_position]


def main() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints and logs go to stderr, never into the answers
    sys.stdout = sys.stderr
    import vllm
    from vllm import LLM, SamplingParams

    if len(sys.argv) > 2:
        return serve(out, json.loads(sys.argv[2]))
    start = time.perf_counter()
    llm = LLM(model=sys.argv[1], dtype="float32", max_logprobs=MAX_LOGPROBS, enforce_eager=True,
              enable_prefix_caching=False, max_model_len=int(os.environ.get("HARNESS_VLLM_MAX_LEN", "4096")), seed=0)
    info = {"kind": "vllm", "vllm": vllm.__version__, "model": os.path.basename(sys.argv[1].rstrip("/")),
            "max_logprobs": MAX_LOGPROBS, "load_seconds": round(time.perf_counter() - start, 1)}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    out.write(json.dumps({"ready": info}) + "\n")

    def gen(prompts: List[List[int]], params: Any) -> List[Any]:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def handle(req: Dict[str, Any]) -> Dict[str, Any]:
        op = req["op"]
        if op == "info":
            return info
        if op == "score":
            k = int(req["k"])
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=k, prompt_logprobs=k,
                                     detokenize=False) for m in req["max_new"]]
            return {"scored": [{"tokens": list(o.outputs[0].token_ids),
                                "rows": _rows(o.prompt_logprobs[1:], k) + _rows(o.outputs[0].logprobs, k)}
                               for o in gen(req["prompts"], params)]}
        if op == "sample":
            p = req["params"]
            params = [SamplingParams(temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"],
                                     min_p=p["min_p"], seed=req["seed"] + i, max_tokens=1, ignore_eos=True,
                                     detokenize=False) for i in range(req["n"])]
            return {"tokens": [o.outputs[0].token_ids[0] for o in gen([req["prompt"]] * req["n"], params)]}
        if op == "timed":
            params = SamplingParams(temperature=0.0, max_tokens=req["max_new"], ignore_eos=True, detokenize=False)
            t0 = time.perf_counter()
            gen(req["prompts"], params)
            return {"seconds": time.perf_counter() - t0}
        return {"error": f"unknown op {op!r}"}

    for line in sys.stdin:
        try:
            answer = handle(json.loads(line))
        except Exception as e:  # the harness shows it; the worker stays up for the next request
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
    return 0


async def _replay(engine: Any, trace: Dict[str, Any], run: int) -> List[Dict[str, Any]]:
    import asyncio

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    cap = trace.get("concurrency")
    slots = asyncio.Semaphore(cap) if cap else None
    reqs = trace["requests"]
    timings = [{"prompt_len": len(r["prompt"]), "sent": 0.0, "times": [], "tokens": [], "error": ""} for r in reqs]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        r, t = reqs[i], timings[i]
        t["sent"] = r["arrival_s"]
        if slots is not None:
            held = slots.locked()
            await slots.acquire()
            if held:  # it waited for a slot: sent when one freed
                t["sent"] = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        try:
            async for o in engine.generate({"prompt_token_ids": r["prompt"]}, params, request_id=f"{run}-{i}"):
                n = len(o.outputs[0].token_ids)
                if n:
                    t["times"].append(time.perf_counter() - t0)
                    t["tokens"].append(n)
        except Exception as e:  # the request failed; the run goes on
            t["error"] = f"{type(e).__name__}: {e}"
        finally:
            if slots is not None:
                slots.release()

    tasks = []
    for i, r in enumerate(reqs):
        delay = r["arrival_s"] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return timings


def serve(out: Any, options: Dict[str, Any]) -> int:
    """The serving mode (module docstring): vLLM's AsyncLLM in fp32, eager, prefix caching off, as the LLM above."""
    import asyncio

    import vllm
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()  # the engine's output handler lives on it between runs
    asyncio.set_event_loop(loop)
    start = time.perf_counter()
    args = AsyncEngineArgs(model=sys.argv[1], dtype="float32", enforce_eager=True, enable_prefix_caching=False,
                           max_model_len=options["max_seq_len"], max_num_seqs=options["slots"], seed=0,
                           disable_log_stats=True)
    engine = AsyncLLM.from_engine_args(args)
    info = {"kind": "vllm", "vllm": vllm.__version__, "model": os.path.basename(sys.argv[1].rstrip("/")),
            "engine": "AsyncLLM", "max_num_seqs": options["slots"],
            "max_num_batched_tokens": engine.vllm_config.scheduler_config.max_num_batched_tokens,
            "chunked_prefill": engine.vllm_config.scheduler_config.enable_chunked_prefill,
            "load_seconds": round(time.perf_counter() - start, 1)}
    out.write(json.dumps({"ready": info}) + "\n")
    for run, line in enumerate(sys.stdin):
        try:
            req = json.loads(line)
            if req["op"] != "serve":
                raise ValueError(f"the serving worker answers serve only, not {req['op']!r}")
            answer: Dict[str, Any] = {"timings": loop.run_until_complete(_replay(engine, req["trace"], run))}
        except Exception as e:
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
    engine.shutdown()
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which re-imports the main module
    sys.exit(main())
