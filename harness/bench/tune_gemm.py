"""python -m harness.bench.tune_gemm --model NAME ...: measure every skinny-GEMM configuration on this GPU for the
models' decode shapes (their projections and LM head, at 1, 2, 4, 8 and 16 rows) and write the fastest of each into
engine/kernels/skinny_gemm_tuned.json under this device's name (other devices' entries are kept), or null where
cuBLAS is faster: the engine then keeps cuBLAS for that shape.

Each configuration is checked against cuBLAS before it is timed (a wrong one would be fast for nothing), and timed
as the bench times a GEMM (harness/bench/gemm.py: calls back to back in one CUDA graph, each over its own weight
copy, so the weight comes from memory). The table prints the best configuration's bandwidth beside cuBLAS's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from engine.kernels import skinny_gemm
from engine.models.config import ModelConfig
from engine.utils.device import has_triton
from harness.bench.gemm import MIN_CALLS, REPLAYS, _time_per_call, weight_copies
from harness.models import add_model_arguments, resolve_models
from harness.report import markdown_table

ROWS = (1, 2, 4, 8, 16)


def decode_shapes(config: ModelConfig, tp: int = 1) -> Dict[str, Tuple[int, int]]:
    """(N, K) of each projection a decode step runs through the skinny GEMM, at tensor-parallel size tp."""
    d, hq, hkv = config.head_dim, config.num_qo_heads // tp, max(1, config.num_kv_heads // tp)
    shapes = {"qkv_proj": ((hq + 2 * hkv) * d, config.hidden_size), "o_proj": (config.hidden_size, hq * d),
              "lm_head": (-(-config.vocab_size // tp), config.hidden_size)}
    if not config.moe_layers or not all(config.moe_layers):  # dense MLP layers (MoE experts take grouped GEMMs)
        inter = config.intermediate_size // tp
        shapes.update(gate_up_proj=(2 * inter, config.hidden_size), down_proj=(config.hidden_size, inter))
    return shapes


def _time(x: torch.Tensor, fn: Callable, copies: List[torch.Tensor]) -> float:
    """Seconds per call of fn(x, w), cycling over the weight copies (harness/bench/gemm.py's timing)."""
    return _time_per_call([lambda x, w=w: fn(x, w) for w in copies], x, max(MIN_CALLS, len(copies)))


@torch.inference_mode()
def tune_shape(n: int, k: int, m: int, dtype: torch.dtype, bandwidth: float) -> Dict[str, object]:
    device = torch.device("cuda")
    weight = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    copies = [weight.clone() for _ in range(weight_copies(weight.numel() * weight.element_size(), device))]
    x = torch.randn(m, k, dtype=dtype, device=device)
    ref = F.linear(x.double(), weight.double())
    bound = 2 * (F.linear(x, weight).double() - ref).abs().max().item() + 1e-2
    best, best_secs = None, float("inf")
    for config in skinny_gemm.search_space(skinny_gemm.block_m(m), k):
        err = (skinny_gemm.skinny_gemm(x, weight, config=config).double() - ref).abs().max().item()
        if not err <= bound:
            raise AssertionError(f"skinny GEMM {config} at M={m} N={n} K={k}: error {err:.3g} > {bound:.3g}")
        secs = _time(x, lambda x, w, c=config: skinny_gemm.skinny_gemm(x, w, config=c), copies)
        if secs < best_secs:
            best, best_secs = config, secs
    cublas = _time(x, F.linear, copies)
    nbytes = weight.numel() * weight.element_size()
    # the entry: the fastest configuration, or None (cuBLAS) where cuBLAS is faster
    return {"M": m, "N": n, "K": k, "config": list(best) if best_secs < cublas else None, "best": list(best),
            "us": best_secs * 1e6, "cublas_us": cublas * 1e6,
            "fraction": nbytes / best_secs / bandwidth, "cublas_fraction": nbytes / cublas / bandwidth}


def report_markdown(rows: List[Dict[str, object]], device: str, bandwidth: float, argv: List[str]) -> str:
    """The measured rows as the committed report: the command, the machine and its versions, then one row a shape."""
    import triton

    def config(c: object) -> str:
        return "cuBLAS" if c is None else str(tuple(c))

    table = [{"M": r["M"], "N": r["N"], "K": r["K"], "skinny best": config(r["best"]), "skinny us": r["us"],
              "skinny % of bw": f"{100 * r['fraction']:.0f}%", "cuBLAS us": r["cublas_us"],
              "cuBLAS % of bw": f"{100 * r['cublas_fraction']:.0f}%", "entry": config(r["config"])} for r in rows]
    return (f"# Skinny GEMM against cuBLAS on the {device}, per decode shape\n\n"
            f"Command: `python -m harness.bench.tune_gemm {' '.join(argv)}` on one {device}, torch "
            f"{torch.__version__}, Triton {triton.__version__}, {time.strftime('%Y-%m-%d')}; bandwidth measured in "
            f"the same run: {bandwidth / 1e12:.2f} TB/s (a large device copy, read + write). Each time is one call, "
            f"from {MIN_CALLS}+ calls back to back in one CUDA graph, each over its own copy of the weight (copies: "
            f"four times the L2 cache), median of {REPLAYS} replays; every configuration was checked against a "
            "float64 product (within twice cuBLAS's largest error plus 0.01) before it was timed. `skinny best` is the "
            "fastest configuration (BLOCK_N, BLOCK_K, warps; at one row a BLOCK_K of K or more holds all of K at once) "
            "and `entry` what `engine/kernels/skinny_gemm_tuned.json` holds: that configuration, or cuBLAS where "
            "cuBLAS was faster."
            + ("" if {r["M"] for r in rows} >= set(ROWS) else
               " The table's entries for other row counts were kept from its earlier runs.")
            + "\n\n" + markdown_table(table))


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.bench.tune_gemm", description=__doc__.split("\n\n")[0])
    add_model_arguments(p, "none, give one or more")
    p.add_argument("--rows", type=int, action="append", choices=ROWS,
                   help=f"tune these row counts only (repeatable; default all of {ROWS}); other entries are kept")
    p.add_argument("--tp", type=int, default=1, help="the shapes of one rank at this tensor-parallel size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--json", help="also write the measured rows here")
    p.add_argument("--report", help="also write the table as markdown here, with the run's provenance")
    args = p.parse_args(argv)
    if not args.model and not args.model_path:
        p.error("give the models whose shapes to tune: --model NAME or --model-path DIR")
    if not torch.cuda.is_available() or not has_triton():
        print("error: tune_gemm needs a CUDA device and Triton", file=sys.stderr)
        return 2
    from harness.bench.limits import measure_limits

    dtype = getattr(torch, args.dtype)
    bandwidth = measure_limits(torch.device("cuda"), dtype).bandwidth
    shapes = sorted({s for ref in resolve_models(args, [], weights=False, tokenizer=False, verb="tune_gemm")
                     for s in decode_shapes(ref.config, args.tp).values()})
    rows, start = [], time.perf_counter()
    for i, (n, k) in enumerate(shapes):
        for m in args.rows or ROWS:
            rows.append(tune_shape(n, k, m, dtype, bandwidth))
            r = rows[-1]
            print(f"[{i + 1}/{len(shapes)}] M={m:2d} N={n:6d} K={k:5d} {tuple(r['best'])}: {r['us']:7.2f} us "
                  f"({100 * r['fraction']:3.0f}% of {bandwidth / 1e12:.2f} TB/s), cuBLAS {r['cublas_us']:7.2f} us "
                  f"({100 * r['cublas_fraction']:3.0f}%) -> {'skinny' if r['config'] else 'cuBLAS'}  "
                  f"[{time.perf_counter() - start:.0f} s]", flush=True)
    name = torch.cuda.get_device_properties(0).name
    table = json.loads(skinny_gemm.TABLE.read_text()) if skinny_gemm.TABLE.exists() else {}
    entries = table.setdefault(name, {})
    entries.update({f"{r['M']},{r['N']},{r['K']}": r["config"] for r in rows})
    table[name] = dict(sorted(entries.items(), key=lambda kv: tuple(map(int, kv[0].split(",")))))
    skinny_gemm.TABLE.write_text(json.dumps(table, indent=1) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "bandwidth": bandwidth, "torch": torch.__version__, "rows": rows}, f, indent=1)
    if args.report:
        with open(args.report, "w") as f:
            f.write(report_markdown(rows, name, bandwidth, argv if argv is not None else sys.argv[1:]))
    print(f"wrote {len(rows)} entries for {name} to {skinny_gemm.TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
