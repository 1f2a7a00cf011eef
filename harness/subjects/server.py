"""python -m harness serve: a small OpenAI-compatible completions server over a driven engine (this project's, or
python:MODULE:CLASS), for testing the `openai:` door against an engine whose numbers are known. Not a serving
engine: requests run one at a time (the driver is not shared), each request's n choices as one batch.

POST /v1/completions takes prompt (token ids or text), max_tokens, temperature, top_p and the extensions top_k,
min_p, ignore_eos, return_tokens_as_token_ids (vLLM's), n, seed, echo and logprobs (at most max_logprobs: more
is a 400, as vLLM answers); GET /v1/models names the model, and the server (owned_by, as vLLM's names itself).
With stream (no logprobs), the choices' tokens go out as server-sent events as the driver reads them (Driver.serve),
then a usage event when stream_options.include_usage asks for one, then [DONE].
A request with a seed gives choice i the seed seed + i; one without draws fresh seeds, so repeated requests are
independent draws.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List

import torch

from engine.core import SamplingParams
from harness.driver import Arrival, eos_token_ids
from harness.subjects.local import LocalSubject


class Completions:
    """The request -> response logic, over one LocalSubject's driver."""

    def __init__(self, spec: str, folder: Any, max_logprobs: int) -> None:
        from transformers import AutoTokenizer

        self.max_logprobs = max_logprobs
        self.subject = LocalSubject(spec, folder)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.eos = eos_token_ids(folder)
        self.name = folder.name
        self.lock = threading.Lock()

    def _request(self, body: Dict[str, Any]) -> tuple[List[int], List[SamplingParams]]:
        """The prompt's ids and each of the n choices' sampling parameters."""
        prompt = body.get("prompt", "")
        ids = list(map(int, prompt)) if isinstance(prompt, list) else self.tokenizer(prompt).input_ids
        seed = body.get("seed")
        seeds = [seed + i if seed is not None else random.getrandbits(63) for i in range(int(body.get("n", 1)))]
        return ids, [SamplingParams(temperature=float(body.get("temperature", 1.0)), top_k=int(body.get("top_k", -1)),
                                    top_p=float(body.get("top_p", 1.0)), min_p=float(body.get("min_p", 0.0)),
                                    max_tokens=int(body.get("max_tokens", 16)),
                                    ignore_eos=bool(body.get("ignore_eos", False)), seed=s) for s in seeds]

    def __call__(self, body: Dict[str, Any]) -> Dict[str, Any]:
        k = body.get("logprobs")
        if k is not None and int(k) > self.max_logprobs:
            raise ValueError(f"logprobs {k} is more than this server's max_logprobs {self.max_logprobs}")
        echo, as_ids = bool(body.get("echo", False)), bool(body.get("return_tokens_as_token_ids", False))
        ids, params = self._request(body)
        n = len(params)
        rows: Dict[int, Dict[int, torch.Tensor]] = {i: {} for i in range(n)}

        def keep(uid: int, start: int, lp: torch.Tensor) -> None:
            for i in range(lp.shape[0]):
                rows[uid][start + i] = lp[i].clone()

        with self.lock:
            results = self.subject.driver.generate([ids] * n, params, eos_ids=self.eos,
                                                   on_logits=keep if k is not None else None)
        name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: self.tokenizer.decode([t]))
        choices = []
        for i, res in enumerate(results):
            out = res.output_ids
            choice = {"index": i, "text": self.tokenizer.decode(out), "finish_reason": res.finish_reason or "length"}
            if k is not None:
                choice["logprobs"] = self._logprobs(ids, out, rows[i], int(k), echo, name)
            choices.append(choice)
        return {"object": "text_completion", "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": sum(len(r.output_ids) for r in results)}}

    def check(self, body: Dict[str, Any]) -> None:
        """A streamed request this server cannot answer, refused before its stream starts (a 400)."""
        if body.get("logprobs") is not None or body.get("echo"):
            raise ValueError("this server streams tokens only: ask for logprobs or echo without stream")
        ids, params = self._request(body)
        for uid, p in enumerate(params):
            self.subject.driver.check_fits(uid, len(ids), p.max_tokens)

    def stream(self, body: Dict[str, Any], send: Callable[[Dict[str, Any]], None]) -> None:
        """A streamed completion: an event per token as the host reads it (text_completion chunks, as vLLM's)."""
        ids, params = self._request(body)
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        pending = [Arrival(i, ids, p) for i, p in enumerate(params)]
        finished: Dict[int, str] = {}
        count = [0]

        class Once:
            def take(self, done: int, wait: bool) -> List[Arrival] | None:
                nonlocal pending
                got, pending = pending, None
                return got

        def token(uid: int, tok: int, at: float) -> None:
            count[0] += 1
            send({"object": "text_completion", "model": self.name, "choices": [
                {"index": uid, "text": f"token_id:{tok}" if as_ids else self.tokenizer.decode([tok]),
                 "finish_reason": None}]})

        with self.lock:
            self.subject.driver.serve(Once(), self.eos, on_token=token,
                                      on_finish=lambda r: finished.__setitem__(r.uid, r.finish_reason))
        for uid in sorted(finished):
            send({"object": "text_completion", "model": self.name,
                  "choices": [{"index": uid, "text": "", "finish_reason": finished[uid] or "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            send({"object": "text_completion", "model": self.name, "choices": [],
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": count[0]}})

    @staticmethod
    def _logprobs(prompt: List[int], out: List[int], rows: Dict[int, torch.Tensor], k: int, echo: bool,
                  name: Any) -> Dict[str, Any]:
        """OpenAI's legacy logprobs: token i's entry is the distribution that predicted it (position i - 1), so an
        echoed prompt's first token has none."""
        seq = (prompt if echo else []) + out
        first = 0 if echo else len(prompt)
        tokens, token_lp, top = [], [], []
        for j, t in enumerate(seq):
            pos = first + j - 1
            tokens.append(name(t))
            if pos < 0 or pos not in rows:
                token_lp.append(None)
                top.append(None)
                continue
            lp = rows[pos]
            best = lp.topk(k) if k > 0 else None
            token_lp.append(float(lp[t]))
            entry = {} if best is None else {name(int(i)): float(v) for i, v in zip(best.indices, best.values)}
            entry.setdefault(name(t), float(lp[t]))
            top.append(entry)
        return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top, "text_offset": []}


def _handler(completions: Completions) -> type:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: Dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": completions.name, "object": "model",
                                                             "owned_by": "harness serve"}]})
            else:
                self._send(404, {"error": {"message": f"no {self.path}"}})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/v1/completions":
                self._send(404, {"error": {"message": f"no {self.path}"}})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if body.get("stream"):
                    self._stream(body)
                else:
                    self._send(200, completions(body))
            except (ValueError, TypeError, KeyError) as e:  # a request the engine cannot take: the client's error
                self._send(400, {"error": {"message": f"{type(e).__name__}: {e}"}})

        def _stream(self, body: Dict[str, Any]) -> None:
            """Server-sent events; the connection's end closes the stream (HTTP/1.0)."""
            completions.check(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def send(event: Dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()

            completions.stream(body, send)
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: Any) -> None:  # one line per request would drown the harness's own
            pass

    return Handler


class Server(ThreadingHTTPServer):
    """A server on host:port (port 0: any free one, see .server_address); serve_forever is the caller's, and so is
    close(), which also shuts the engine down."""

    def __init__(self, spec: str, folder: Any, host: str = "127.0.0.1", port: int = 0, max_logprobs: int = 64) -> None:
        self.completions = Completions(spec, folder, max_logprobs)
        super().__init__((host, port), _handler(self.completions))

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.completions.subject.close()


def command(args: argparse.Namespace) -> int:
    from harness import subjects
    from harness.models import resolve_models

    model = resolve_models(args, ("smollm2-135m",), verb="serve")[0]
    subjects.engine_class(args.engine)
    server = Server(args.engine, model.folder, args.host, args.port, args.max_logprobs)
    print(f"serving {model.name} ({args.engine}) at {server.url}/v1: --engine openai:{server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.completions.subject.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from harness.models import add_model_arguments

    p = sub.add_parser("serve", help="an OpenAI-compatible completions server over this engine (or python:M:C), "
                                     "for testing the openai: door")
    add_model_arguments(p, "smollm2-135m")
    p.add_argument("--engine", default="engine", metavar="python:MODULE:CLASS", help="the driven engine it serves")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--max-logprobs", type=int, default=64, help="the most log-probabilities a request may ask for")
    p.set_defaults(func=command)
