"""Arrival traces for the serving benchmark: which requests arrive when, and their replay through a driver.

A trace is a list of requests (prompt token ids, output length, arrival time in seconds from the trace's start) and an
optional concurrency cap (at most that many requests in flight: a request that has arrived waits for a slot, as
`vllm bench serve --max-concurrency` holds it). Arrivals as vLLM's serving benchmark draws them: the gaps between
requests from a gamma distribution of shape `burstiness` and mean 1 / rate (burstiness 1: a Poisson process; below 1
burstier, above 1 more regular), their sum rescaled to n / rate; rate inf: every request at 0. One seed fixes the
lengths, the prompts and the gaps, so a trace at another rate is the same requests arriving at another pace.

Lengths: `uniform:IN:OUT[:RATIO]` (vLLM's random dataset: each length uniform in [L (1 - RATIO), L (1 + RATIO)]) or
`lognormal:IN:OUT[:SIGMA]` (medians IN and OUT, log-standard deviation SIGMA: the long tail of chat traffic), and
optionally `,long:LEN:SHARE`: that share of the requests (seeded) get a prompt of LEN tokens instead (the arrival of
long prompts among running requests). Prompts are random token ids or excerpts of a text (harness.bench.serving).

This module imports the standard library only: a revision under test replays the same trace through its own driver
(harness.bench.ab_runner loads this file by path).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

INF = float("inf")


@dataclass
class TraceRequest:
    prompt: List[int]
    output_len: int
    arrival_s: float  # seconds after the trace starts


@dataclass
class Trace:
    requests: List[TraceRequest]
    rate: float = INF  # requests a second it was drawn at (inf: all at once)
    burstiness: float = 1.0
    concurrency: int | None = None  # at most this many in flight
    about: Dict[str, Any] = field(default_factory=dict)  # how it was made (lengths, dataset, seed) or where read from

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        out["rate"] = "inf" if math.isinf(self.rate) else self.rate
        return out

    @classmethod
    def from_json(cls, obj: Dict[str, Any]) -> "Trace":
        reqs = [TraceRequest(list(r["prompt"]), int(r["output_len"]), float(r["arrival_s"])) for r in obj["requests"]]
        return cls(reqs, float(obj.get("rate", INF)), float(obj.get("burstiness", 1.0)), obj.get("concurrency"),
                   obj.get("about", {}))


# ------------------------------------------------------------------------------------------------ making traces
@dataclass(frozen=True)
class Lengths:
    """A named distribution of prompt and output lengths (module docstring)."""

    dist: str  # uniform | lognormal
    input_len: int
    output_len: int
    spread: float  # uniform: the range ratio; lognormal: sigma
    long_len: int = 0
    long_share: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "Lengths":
        """uniform:IN:OUT[:RATIO] or lognormal:IN:OUT[:SIGMA], then optionally ,long:LEN:SHARE; ValueError says
        what is wrong."""
        main, _, long_part = spec.partition(",")
        parts = main.split(":")
        if parts[0] not in ("uniform", "lognormal") or len(parts) not in (3, 4):
            raise ValueError(f"lengths {spec!r}: give uniform:IN:OUT[:RATIO] or lognormal:IN:OUT[:SIGMA], "
                             "optionally followed by ,long:LEN:SHARE")
        spread = float(parts[3]) if len(parts) == 4 else (0.0 if parts[0] == "uniform" else 0.5)
        out = cls(parts[0], int(parts[1]), int(parts[2]), spread)
        if long_part:
            lp = long_part.split(":")
            if len(lp) != 3 or lp[0] != "long":
                raise ValueError(f"lengths {spec!r}: the long prompts are given as ,long:LEN:SHARE")
            out = cls(out.dist, out.input_len, out.output_len, spread, int(lp[1]), float(lp[2]))
        if min(out.input_len, out.output_len) < 1 or not 0 <= out.long_share <= 1 or out.spread < 0 or (
                out.dist == "uniform" and out.spread >= 1) or (out.long_share and out.long_len < 1):
            raise ValueError(f"lengths {spec!r}: lengths must be >= 1, the ratio in [0, 1), the share in [0, 1]")
        return out

    def draw(self, n: int, rng: random.Random) -> List[Tuple[int, int]]:
        """n (prompt length, output length) pairs."""
        def one(length: int) -> int:
            if self.dist == "uniform":
                low, high = math.floor(length * (1 - self.spread)), math.ceil(length * (1 + self.spread))
                return rng.randint(max(1, low), high)
            return max(1, round(length * rng.lognormvariate(0.0, self.spread)))

        pairs = [(one(self.input_len), one(self.output_len)) for _ in range(n)]
        return [(self.long_len if rng.random() < self.long_share else i, o) for i, o in pairs]

    def longest(self) -> int:
        """A bound on prompt + output tokens of any request drawn (lognormal: its 99.9th percentile's)."""
        def top(length: int) -> int:
            if self.dist == "uniform":
                return math.ceil(length * (1 + self.spread))
            return math.ceil(length * math.exp(3.1 * self.spread))
        return max(top(self.input_len), self.long_len) + top(self.output_len)


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> List[float]:
    """vLLM's arrivals: cumulative gamma(burstiness, 1 / (rate burstiness)) gaps, rescaled so that the last arrives
    at n / rate (the sum of random gaps misses it by a few percent, which would move the load a run offers)."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]
    times = [sum(gaps[: i + 1]) for i in range(n)]
    return [t * (n / rate) / times[-1] for t in times]


def make_trace(prompts: Callable[[List[int], random.Random], List[List[int]]], lengths: Lengths, n: int, rate: float,
               burstiness: float, concurrency: int | None, seed: int) -> Trace:
    """n requests of the lengths drawn, their prompts from prompts(lengths, rng), arriving at rate."""
    rng = random.Random(seed)
    drawn = lengths.draw(n, rng)
    ids = prompts([i for i, _ in drawn], rng)
    gaps_rng = random.Random(seed + 1)  # the arrivals apart: the same requests at every rate
    times = arrival_times(n, rate, burstiness, gaps_rng)
    reqs = [TraceRequest(p, o, t) for p, (_, o), t in zip(ids, drawn, times)]
    return Trace(reqs, rate, burstiness, concurrency, {"seed": seed})


def random_prompts(vocab: int) -> Callable[[List[int], random.Random], List[List[int]]]:
    """Random token ids in [10, vocab - 10), as the bench's random_ids draw them (away from special tokens)."""
    return lambda lengths, rng: [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in lengths]


def read_trace(path: Path, tokenize: Callable[[str], List[int]], vocab: int) -> Trace:
    """A trace file: this module's JSON (Trace.to_json), or a JSON list / JSON lines of requests, each with an
    arrival time (arrival_s or timestamp, seconds; the first becomes 0), a prompt (prompt_ids, prompt as text or
    ids, or prompt_len / input_len: random ids of that length) and an output length (output_len, max_tokens or
    output_tokens). ValueError says what is missing."""
    text = Path(path).read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(whole, dict) and "requests" in whole and all("arrival_s" in r and "prompt" in r
                                                               for r in whole["requests"]):
        return Trace.from_json(whole)
    items = whole["requests"] if isinstance(whole, dict) else whole
    rng = random.Random(0)
    reqs = []
    for i, r in enumerate(items):
        at = r.get("arrival_s", r.get("timestamp"))
        out = r.get("output_len", r.get("max_tokens", r.get("output_tokens")))
        prompt = r.get("prompt_ids", r.get("prompt"))
        length = r.get("prompt_len", r.get("input_len"))
        if prompt is None and length is not None:
            prompt = [rng.randrange(10, vocab - 10) for _ in range(int(length))]
        if at is None or out is None or prompt is None:
            raise ValueError(f"request {i} lacks an arrival time (arrival_s or timestamp), a prompt (prompt_ids, "
                             f"prompt, prompt_len or input_len) or an output length (output_len or max_tokens)")
        reqs.append(TraceRequest(tokenize(prompt) if isinstance(prompt, str) else list(map(int, prompt)), int(out),
                                 float(at)))
    if not reqs:
        raise ValueError("it holds no requests")
    first = min(r.arrival_s for r in reqs)
    reqs = sorted((TraceRequest(r.prompt, r.output_len, r.arrival_s - first) for r in reqs), key=lambda r: r.arrival_s)
    rate = len(reqs) / reqs[-1].arrival_s if reqs[-1].arrival_s > 0 else INF
    return Trace(reqs, rate, about={"file": Path(path).name})


# ------------------------------------------------------------------------------------------------ replay
@dataclass
class Timing:
    """One request as its client saw it, seconds from the trace's start: sent (its arrival, or when a concurrency
    slot freed), each chunk of tokens as it came (times, and tokens in each), and an error if it failed."""

    prompt_len: int
    sent: float = 0.0
    times: List[float] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    error: str = ""


class Releaser:
    """When each request of a trace goes out: at its arrival time, and under a concurrency cap only when fewer than
    the cap are in flight. Polled by whoever replays the trace (the driver's loop, a client's dispatcher)."""

    def __init__(self, trace: Trace, clock: Callable[[], float] = time.perf_counter) -> None:
        self.trace, self.clock = trace, clock
        self.t0 = clock()
        self.next = 0
        self.ended: List[float] = []  # when each finished request ended, from t0 (reported in time order)

    def now(self) -> float:
        return self.clock() - self.t0

    def finished(self, at: float) -> None:
        """A request ended at `at` (seconds from t0): under a cap, its slot is free from then."""
        self.ended.append(at)

    def due(self, finished: int) -> List[Tuple[int, float]]:
        """(index, sent time) of each request that goes out now, given how many have finished: its arrival, or
        under a cap the end that freed its slot where that came later (as a client's semaphore sends it)."""
        out, now, cap = [], self.now(), self.trace.concurrency
        reqs = self.trace.requests
        while self.next < len(reqs) and reqs[self.next].arrival_s <= now:
            if cap is not None and self.next - finished >= cap:
                break
            sent = reqs[self.next].arrival_s
            if cap is not None and self.next >= cap:  # its slot freed when the (next - cap + 1)-th request ended
                k = self.next - cap  # (now where that end was not reported: a request stopped early at EOS)
                sent = max(sent, self.ended[k] if k < len(self.ended) else now)
            out.append((self.next, sent))
            self.next += 1
        return out

    def wait(self) -> None:
        """Sleep until the next request's arrival (the caller has nothing in flight)."""
        if self.next < len(self.trace.requests):
            time.sleep(max(0.0, self.trace.requests[self.next].arrival_s - self.now()))

    @property
    def done(self) -> bool:
        return self.next >= len(self.trace.requests)


def replay(driver: Any, trace: Trace, params: Callable[[int], Any], eos_ids: Sequence[int] = ()) -> List[Timing]:
    """The trace through driver.serve (any revision's Driver with serve()): requests handed over as they arrive,
    each token timed as the host reads it. params(output_len): the request's SamplingParams (ignore_eos, so that it
    makes exactly output_len tokens)."""
    from harness.driver import Arrival  # the driver's own module: the revision under test's

    timings = [Timing(len(r.prompt)) for r in trace.requests]
    releaser: Releaser | None = None

    class Source:
        def take(self, finished: int, wait: bool) -> List[Any] | None:
            if releaser.done:
                return None
            if wait:
                releaser.wait()
            out = []
            for i, sent in releaser.due(finished):
                timings[i].sent = sent
                out.append(Arrival(i, trace.requests[i].prompt, params(trace.requests[i].output_len)))
            return out

    def on_token(uid: int, token: int, at: float) -> None:
        timings[uid].times.append(at - releaser.t0)
        timings[uid].tokens.append(1)
        if len(timings[uid].times) == trace.requests[uid].output_len:
            releaser.finished(at - releaser.t0)

    releaser = Releaser(trace)
    driver.serve(Source(), eos_ids, on_token=on_token)
    return timings
