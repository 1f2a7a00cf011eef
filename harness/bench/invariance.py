"""python -m harness bench --batch-invariant: how much a request's output follows its batch in the default mode, and
what batch-invariant mode (EngineConfig.batch_invariant) costs. Both modes run in this one process, one engine each.

- variance: VARIANCE_PROMPTS excerpts of real text (the King James text of golden/prompts-long-context.jsonl, 32 to
  96 tokens at spread offsets) with VARIANCE_TOKENS greedy tokens each, run together in one batch and each alone:
  the share of requests whose tokens change with their batch, and of positions whose log-probabilities are not
  bitwise equal. Batch-invariant mode must show none.
- cost: the bench's engine rows (decode at batch sizes, prefill at lengths, the offline workload) in each mode, the
  modes in the order default, invariant, invariant, default (drift on a shared host cancels to first order), each
  row the faster of its mode's two rounds, and the ratio of their times (invariant / default; above 1 is slower).
Writes build/reports/bench/<device>/batch-invariant/ (reports/... with --update-reports): summary.md, bench.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, progress
from harness.bench.limits import Limits, measure_limits, model_cost
from harness.bench.workloads import SPECS, BenchSpec, engine_offline, engine_prefill, offline_workload
from harness.driver import Driver
from harness.fuzz.runs import digest
from harness.models import ModelRef, as_model, resolve_models
from harness.report import REPO_ROOT, markdown_table, provenance, provenance_markdown, report_root, text_table, \
    write_json, written_to

TEXT = REPO_ROOT / "golden" / "prompts-long-context.jsonl"
VARIANCE_MODEL = "smollm2-135m"
VARIANCE_PROMPTS = 32
VARIANCE_TOKENS = 64
MODES = {"default": False, "batch-invariant": True}
REPORTED = ("requests", "requests_changed", "share_changed", "positions", "positions_differing")
# the workloads compared, per device: decode batch sizes, prefill lengths (the offline workload is the spec's)
COST = {"cpu": ([1, 16], [128, 512]), "cuda": ([1, 64, 256], [512, 4096])}


def real_prompts(tokenizer: Any, n: int = VARIANCE_PROMPTS) -> List[List[int]]:
    """n excerpts of 32-96 tokens at offsets spread over the text (deterministic)."""
    ids: List[int] = []
    for line in TEXT.read_text().splitlines():
        ids += tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(0)
    lengths = rng.integers(32, 97, n)
    starts = np.linspace(0, len(ids) - 97, n).astype(int)
    return [ids[s: s + k] for s, k in zip(starts.tolist(), lengths.tolist())]


def batch_variance(driver: Driver, prompts: List[List[int]], params: SamplingParams | List[SamplingParams],
                   prefix_lens: List[int] | None = None) -> Dict[str, Any]:
    """The prompts together and each alone (with its own params and cached-prefix split): the requests whose tokens
    differ, how many positions' log-probabilities are not bitwise equal, and how many positions one run computed and
    the other did not (none, unless the driver's steps follow the batch)."""
    plist = list(params) if isinstance(params, list) else [params] * len(prompts)

    def run(ps: List[List[int]], pp: List[SamplingParams], prefixes: List[int] | None) -> tuple:
        digests: Dict[tuple, bytes] = {}

        def hook(uid: int, start: int, lp: torch.Tensor) -> None:
            for i in range(lp.shape[0]):
                digests[(uid, start + i)] = digest(lp[i])

        results = driver.generate(ps, pp, prefix_lens=prefixes, on_logits=hook)
        return digests, [r.output_ids for r in results]

    together, outputs = run(prompts, plist, prefix_lens)
    changed, positions, unmatched = [], 0, 0
    for i, prompt in enumerate(prompts):
        alone, alone_out = run([prompt], [plist[i]], None if prefix_lens is None else [prefix_lens[i]])
        if alone_out[0] != outputs[i]:
            changed.append(i)
        mine = {pos for uid, pos in together if uid == i}
        unmatched += len(mine ^ {pos for _, pos in alone})
        positions += sum(together[(i, pos)] != d for (_, pos), d in alone.items() if pos in mine)
    return {"requests": len(prompts), "requests_changed": len(changed), "share_changed": len(changed) / len(prompts),
            "positions": len(together), "positions_differing": positions, "positions_unmatched": unmatched,
            "changed": changed}


def _cost_rows(ref: ModelRef, device: str, dtype: str, spec: BenchSpec, limits: Limits,
               mode: str) -> List[Dict[str, Any]]:
    from harness.bench.run import _decode_rows, _engine, _offline_row, _progress, _row

    clock = progress.Stopwatch()
    engine = _engine(ref, device, dtype, spec, graphs=True, batch_invariant=MODES[mode])
    cost, vocab = model_cost(engine), engine.config.model_config.vocab_size
    driver, rows = Driver(engine), []
    decode_bs, lengths = COST[device.split(":")[0]]
    try:
        for bs in decode_bs:
            row = _decode_rows(ref.name, mode, driver, bs, spec.decode_ctx, spec, vocab, cost, limits)[0]
            rows.append(_progress(row, clock))
        for n in lengths:
            secs = [r.seconds for r in engine_prefill(driver, n, vocab, spec.repeats)]
            rows.append(_progress(_row(ref.name, mode, "prefill", 1, n, secs, n, cost, limits,
                                       (n, 0, n * (n + 1) // 2, 1)), clock))
        run = engine_offline(driver, *offline_workload(*spec.offline))
        rows.append(_progress(_offline_row(ref.name, mode, "offline", run, cost, limits), clock))
    finally:
        engine.shutdown()
    return rows


def _rounds(ref: ModelRef, device: str, dtype: str, spec: BenchSpec, limits: Limits) -> List[List[Dict[str, Any]]]:
    """Each row's measurements over the rounds, in the order default, invariant, invariant, default."""
    by_key: Dict[tuple, List[Dict[str, Any]]] = {}
    for mode in ("default", "batch-invariant", "batch-invariant", "default"):
        for row in _cost_rows(ref, device, dtype, spec, limits, mode):
            by_key.setdefault((row["runner"], row["workload"], row["batch_size"], row["length"]), []).append(row)
    return list(by_key.values())


def _faster(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    best = min(rounds, key=lambda r: r["median_s"])
    return dict(best, rounds_s=[r["median_s"] for r in rounds])


def _variance(device: str, dtype: str) -> List[Dict[str, Any]]:
    from transformers import AutoTokenizer

    ref = as_model(VARIANCE_MODEL)
    prompts = real_prompts(AutoTokenizer.from_pretrained(ref.folder))
    out, clock = [], progress.Stopwatch()
    for mode, invariant in MODES.items():
        engine = Engine(EngineConfig(model_path=str(ref.folder), tp_info=DistributedInfo(0, 1), device=device,
                                     dtype=getattr(torch, dtype), max_running_req=VARIANCE_PROMPTS,
                                     max_seq_len_override=256, batch_invariant=invariant))
        try:
            params = SamplingParams(max_tokens=VARIANCE_TOKENS, ignore_eos=True)
            measured = batch_variance(Driver(engine), prompts, params)
            row = dict(model=ref.name, mode=mode, **{k: measured[k] for k in REPORTED})
        finally:
            engine.shutdown()
        progress.line("bench", f"{ref.name} {mode} batch variance", f"{row['requests_changed']}/{row['requests']} "
                      "requests changed", clock.lap())
        out.append(row)
    return out


def _ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    base = {(r["model"], r["workload"], r["batch_size"], r["length"]): r for r in rows if r["runner"] == "default"}
    out = []
    for r in rows:
        b = base.get((r["model"], r["workload"], r["batch_size"], r["length"]))
        if r["runner"] != "default" and b is not None:
            out.append({"model": r["model"], "workload": r["workload"], "batch_size": r["batch_size"],
                        "length": r["length"], "default_ms": 1e3 * b["median_s"], "invariant_ms": 1e3 * r["median_s"],
                        "ratio": r["median_s"] / b["median_s"]})
    return out


def write_report(result: Dict[str, Any], update: bool) -> tuple[Path, str]:
    out = report_root(update) / "bench" / result["device"].split(":")[0] / "batch-invariant"
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench.json", result)
    variance, ratios = result["variance"], result["ratios"]
    text = (f"batch variance ({VARIANCE_MODEL}, {VARIANCE_PROMPTS} prompts of real text, {VARIANCE_TOKENS} greedy "
            f"tokens, together against alone):\n{text_table(variance)}\n\ncost of batch-invariant mode (ratio = "
            f"invariant / default time):\n{text_table(ratios)}")
    worst = max((r["ratio"] for r in ratios), default=float("nan"))
    md = (f"# Batch-invariant mode on {result['provenance']['device_name']} ({result['dtype']})\n\n"
          "`EngineConfig.batch_invariant`: a request's log-probabilities and greedy and seeded tokens are bitwise those "
          "of the request alone, in any batch. Both modes ran in this one process, one engine each.\n\n"
          f"## Batch variance\n{VARIANCE_PROMPTS} excerpts of the King James text (golden/prompts-long-context.jsonl, "
          f"32-96 tokens), {VARIANCE_TOKENS} greedy tokens each, in one batch and each alone.\n\n"
          f"{markdown_table(variance)}\n## Cost\nThe bench's engine rows in each mode (decode: the step's period at "
          f"context {result['spec']['decode_ctx']}; prefill: one request; offline: the whole workload), in the order "
          f"default, invariant, invariant, default, each the faster of its mode's two rounds. Ratio = invariant / "
          f"default time; the largest here {worst:.3g}.\n\n{markdown_table(ratios)}\n"
          f"## Provenance\n{provenance_markdown(result['provenance'])}")
    (out / "summary.md").write_text(md)
    return out / "summary.md", text


def command(args: argparse.Namespace) -> int:
    device = args.device
    if device.startswith("cuda"):
        raise UserError("--batch-invariant: the engine's batch-invariant mode runs on the CPU only; use --device cpu")
    check_device(device)
    models = resolve_models(args, ["smollm2-135m"], weights=False, tokenizer=False, verb="bench")
    kind = device.split(":")[0]
    spec, dtype = SPECS[kind], {"cpu": "float32", "cuda": "bfloat16"}[kind]
    limits = measure_limits(torch.device(device), getattr(torch, dtype))
    rows = [_faster(rounds) for ref in models for rounds in _rounds(ref, device, dtype, spec, limits)]
    variance = _variance(device, dtype)
    result = {"device": device, "dtype": dtype, "spec": vars(spec), "rows": rows, "ratios": _ratios(rows),
              "variance": variance, "provenance": provenance(device, dtype=dtype)}
    path, text = write_report(result, args.update_reports)
    print(text)
    print(written_to(path, args.update_reports))
    broken = [v for v in variance if MODES[v["mode"]] and (v["requests_changed"] or v["positions_differing"])]
    if broken:
        print(f"FAIL: batch-invariant mode changed {broken[0]['positions_differing']} positions with the batch")
        return EXIT_FINDING
    return EXIT_PASS
