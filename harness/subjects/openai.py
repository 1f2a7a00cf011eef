"""`--engine openai:URL`: an OpenAI-compatible completions server (vLLM, SGLang, llama.cpp's server, TGI, `python -m
harness serve`) as a Subject, over HTTP with the standard library.

Log-probabilities: prompts go as token ids; a prompt position's row comes from `prompt_logprobs` where the server has
it (vLLM, SGLang), else from `echo` with `logprobs`; a generated position's from `logprobs`. Tokens are read as ids
where the server names them so (vLLM's `return_tokens_as_token_ids`), else mapped back from their text through the
model's tokenizer (a text that several ids decode to is left out of its row). Draws are not seeded (servers differ on
what a seed with n > 1 means): up to MAX_N choices a request, or one a request where the server refuses more (vLLM
refuses n > 1 at temperature 0). A request the server refuses (HTTP 4xx) is Unsupported, with the server's own words:
the check that needs it is left out in one line. The server is named in the provenance as its /v1/models owner and
/version say (vLLM: "vllm 0.32.0").

Serving: each request of a trace streams its completion (`stream`, with `stream_options.include_usage`) in a thread
of its own, sent at its arrival (a semaphore for a concurrency cap), each chunk timed as it comes, as `vllm bench
serve` times its openai backend; the usage's completion_tokens, where the server gives it, counts the tokens.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np

from engine.core import SamplingParams
from harness import UserError
from harness.bench.arrivals import Timing, Trace
from harness.subjects.base import MIN_TOP_K, Scored, Subject, Unsupported, rows

MAX_N = 256
TRIED_K = (64, MIN_TOP_K)  # the top-K asked for first; a server that refuses it is asked for MIN_TOP_K
TIMEOUT = 600.0
CONCURRENT = 16  # requests in flight at once: a server batches what arrives together


def check_url(url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise UserError(f"--engine openai:{url}: give the server's address, e.g. openai:http://127.0.0.1:8000")


def endpoint(url: str, path: str) -> str:
    base = url.rstrip("/")
    return f"{base}/{path}" if base.endswith("/v1") else f"{base}/v1/{path}"


class Refused(Unsupported):
    """A request the server answered with HTTP 4xx: what it said."""


def _refusal(url: str, e: urllib.error.HTTPError) -> Refused:
    try:
        said = json.loads(e.read()).get("error", {})
        said = said.get("message", said) if isinstance(said, dict) else said
    except (ValueError, AttributeError, OSError):
        said = e.reason
    return Refused(f"--engine openai:{url} refuses the request (HTTP {e.code}): {' '.join(str(said).split())}")


class OpenAISubject(Subject):
    seeded = False

    def __init__(self, url: str, folder: Path) -> None:
        check_url(url)
        self.url, self.folder = url, folder
        try:
            models = self._request("models")["data"]
        except (urllib.error.URLError, OSError) as e:
            raise UserError(f"--engine openai:{url}: no server answers there ({e}); start it, or check the "
                            f"address") from None
        self.model = models[0]["id"]
        self.server = " ".join(x for x in (models[0].get("owned_by"), self._version()) if x)
        self.top_k = TRIED_K[0]
        self._by_text: Dict[str, int] | None = None

    def _request(self, path: str, body: Dict[str, Any] | None = None) -> Dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(endpoint(self.url, path), data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if 400 <= e.code < 500:
                raise _refusal(self.url, e) from None
            raise

    def _version(self) -> str:
        """The server's version where it tells one (vLLM's and SGLang's GET /version), else ""."""
        req = urllib.request.Request(f"{self.url.rstrip('/').removesuffix('/v1')}/version")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                return str(json.loads(r.read()).get("version", ""))
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return ""

    def _complete(self, **body: Any) -> Dict[str, Any]:
        return self._request("completions", {"model": self.model, "return_tokens_as_token_ids": True, **body})

    def provenance(self) -> Dict[str, Any]:
        # a served model's name may be the folder it was loaded from: its last part, never a machine's path
        return {"kind": "openai", "server": self.server, "url": self.url, "served_model": Path(self.model).name,
                "model": self.folder.name}

    def _token(self, text: str) -> int | None:
        """A token as the server names it -> its id (None: a text several ids decode to)."""
        if text.startswith("token_id:"):
            return int(text.partition(":")[2])
        if self._by_text is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.folder)
            texts = [tok.decode([i]) for i in range(len(tok))]
            seen: Dict[str, int] = {}
            for i, t in enumerate(texts):
                seen[t] = -1 if t in seen else i
            self._by_text = seen
        i = self._by_text.get(text, -1)
        return None if i < 0 else i

    def _row(self, entry: Dict[str, Any] | None) -> List[tuple]:
        """A top_logprobs entry ({text: logprob}) or a prompt_logprobs one ({id: {"logprob": ...}})."""
        out = []
        for key, value in (entry or {}).items():
            lp = value["logprob"] if isinstance(value, dict) else value
            tid = int(key) if key.lstrip("-").isdigit() else self._token(key)
            if tid is not None:
                out.append((tid, float(lp)))
        return out

    def _score_one(self, prompt: List[int], m: int, k: int) -> Scored:
        got = self._complete(prompt=list(map(int, prompt)), max_tokens=m, temperature=0.0, logprobs=k, echo=True,
                             prompt_logprobs=k, ignore_eos=True)
        choice = got["choices"][0]
        top = choice["logprobs"]["top_logprobs"]
        prompt_part = choice.get("prompt_logprobs") or got.get("prompt_logprobs") or top[:len(prompt)]
        per_position = [self._row(e) for e in prompt_part[1:len(prompt)]] + [self._row(e) for e in top[-m:]]
        tokens = [self._token(t) for t in choice["logprobs"]["tokens"][-m:]]
        return Scored([-1 if t is None else t for t in tokens], *rows(per_position, k))

    def score(self, prompts: Sequence[List[int]], max_new: Sequence[int], k: int) -> List[Scored]:
        k = min(k, self.top_k)
        try:
            self._score_one(list(prompts[0]), 1, k)
        except Refused:
            if k == MIN_TOP_K:
                raise
            self.top_k = k = MIN_TOP_K  # the server caps its logprobs below the goldens' 64
            try:
                self._score_one(list(prompts[0]), 1, k)
            except Refused as e:
                raise Unsupported(f"{e}; asked for logprobs={MIN_TOP_K}, and parity needs the top-{MIN_TOP_K} at "
                                  f"every position") from None
        with ThreadPoolExecutor(CONCURRENT) as pool:
            return list(pool.map(lambda a: self._score_one(list(a[0]), a[1], k), zip(prompts, max_new)))

    def sample(self, prompt: List[int], params: SamplingParams, n: int, seed: int) -> np.ndarray:
        sizes = [min(MAX_N, n - i) for i in range(0, n, MAX_N)]
        body = {"prompt": list(map(int, prompt)), "max_tokens": 1, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p, "logprobs": 1, "ignore_eos": True}

        def one(size: int) -> List[int]:
            got = self._complete(**body, n=size)
            return [self._token(c["logprobs"]["tokens"][0]) for c in got["choices"]]

        try:
            draws = one(sizes[0])
        except Refused:
            if sizes[0] == 1:
                raise
            draws, sizes = one(1), [1] * n  # one choice a request (vLLM's rule at temperature 0); refused now: final
        with ThreadPoolExecutor(CONCURRENT) as pool:
            draws += [t for chunk in pool.map(one, sizes[1:]) for t in chunk]
        return np.array([-2 if t is None else t for t in draws], dtype=np.int64)

    def timed(self, prompts: Sequence[List[int]], max_new: int) -> float:
        start = time.perf_counter()
        with ThreadPoolExecutor(max(len(prompts), 1)) as pool:
            list(pool.map(lambda p: self._complete(prompt=list(map(int, p)), max_tokens=max_new, temperature=0.0,
                                                   ignore_eos=True), prompts))
        return time.perf_counter() - start

    def serve(self, trace: Trace) -> List[Timing]:
        timings = [Timing(len(r.prompt)) for r in trace.requests]
        slots = threading.Semaphore(trace.concurrency) if trace.concurrency else None
        threads = []
        t0 = time.perf_counter()
        for r, t in zip(trace.requests, timings):
            time.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
            t.sent = r.arrival_s
            if slots is not None and not slots.acquire(blocking=False):
                slots.acquire()  # it waited for a slot: sent when one freed
                t.sent = time.perf_counter() - t0
            body = {"model": self.model, "prompt": list(map(int, r.prompt)), "max_tokens": r.output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            threads.append(threading.Thread(target=self._stream, args=(body, t, t0, slots), daemon=True))
            threads[-1].start()
        for th in threads:
            th.join()
        return timings

    def _stream(self, body: Dict[str, Any], t: Timing, t0: float, slots: threading.Semaphore | None) -> None:
        """One streamed completion into t: a chunk of each event that carries a choice, until [DONE]."""
        req = urllib.request.Request(endpoint(self.url, "completions"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        usage = None
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    choice = (event.get("choices") or [None])[0]
                    # a chunk of tokens (its text may be empty: a special token), not a bare finish marker
                    if choice is not None and (choice.get("text") or not choice.get("finish_reason")):
                        t.times.append(time.perf_counter() - t0)
                        t.tokens.append(1)
                    usage = event.get("usage") or usage
            if usage and t.tokens and usage.get("completion_tokens", 0) > sum(t.tokens):
                t.tokens[-1] += usage["completion_tokens"] - sum(t.tokens)  # a chunk carried several
            if not t.times:
                t.error = "the stream carried no tokens"
        except (urllib.error.URLError, OSError, ValueError) as e:
            t.error = f"{type(e).__name__}: {e}"
        finally:
            if slots is not None:
                slots.release()
