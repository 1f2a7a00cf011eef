"""The MoE backends and the tiny MoE model: routing spread, the fused path's grouping against the reference, router
margins and their near-tie detection (planted), and on CUDA the fused kernel against the reference, both measured
against fp32, and its CUDA graphs."""

from __future__ import annotations

import collections
import json
from typing import Dict, List

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from engine.moe import router_margin
from engine.moe.fused import FusedMoE
from engine.moe.torch_backend import TorchMoE
from harness import golden as G
from harness import zoo
from harness.compare import ROUTER_TIE, PositionStat
from harness.driver import Driver
from harness.models import as_model
from harness.parity.gate import dist_limits, evaluate, tie_tolerance, tolerance
from harness.parity.paths import PATHS
from harness.parity.report import write_report
from harness.parity.run import run_parity

MODEL = "tiny-qwen3-moe"


def _golden_sequences() -> List[List[int]]:
    gs = G.load_checked(MODEL, "cpu", "float32")
    return [list(map(int, p.prompt_ids)) + list(map(int, p.tokens)) for p in gs.prompts]


def test_tiny_moe_routing_is_not_degenerate():
    """HF's own top-2 choices on the golden's sequences (every prefill and decode position): the counts in the zoo's
    doc (TINY_MOE_ROUTING), no expert taking more than a third of the choices, top-1 weights a real mixture."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(zoo.path(MODEL), dtype=torch.float32).eval()
    counts: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    top1 = []
    with torch.inference_mode():
        for seq in _golden_sequences():
            out = hf(torch.tensor([seq]), output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                weights, ids = logits.float().softmax(-1).topk(2, dim=-1)
                counts[layer].update(ids.flatten().tolist())
                top1.append(weights[:, 0])
    used = [len(c) for c in counts.values()]
    shares = [max(c.values()) / sum(c.values()) for c in counts.values()]
    mean_top1 = torch.cat(top1).mean().item()
    print(f"experts chosen per MoE layer: {used} of 8; largest share {[round(s, 2) for s in shares]}; "
          f"mean top-1 weight {mean_top1:.2f}")
    assert ", ".join(map(str, used[:-1])) + f" and {used[-1]}" == zoo.TINY_MOE_ROUTING
    assert max(shares) < 1 / 3 and 0.3 < mean_top1 < 0.8


def _moe_inputs(n: int, hidden: int, inter: int, experts: int, dtype: torch.dtype, device: str = "cpu",
                seed: int = 0, unused: int = 0) -> tuple:
    """x, router logits, gate_up, down; the last `unused` experts are never chosen (their logits are -1e4)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, hidden, generator=g, device=device)
    logits = torch.randn(n, experts, generator=g, device=device) * 2
    if unused:
        logits[:, -unused:] = -1e4
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, device=device) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=g, device=device) / inter ** 0.5
    return tuple(t.to(dtype) for t in (x, logits, gate_up, down))


@pytest.mark.parametrize("n, top_k, renormalize, fp32_weights", [(1, 2, False, False), (37, 2, True, False),
                                                                (64, 3, False, True), (5, 8, True, False)])
def test_fused_grouping_equals_the_reference_on_cpu(n, top_k, renormalize, fp32_weights):
    """The fused path's sort, groups (an unchosen expert's empty), offsets and un-permutation, on the CPU in fp32
    (torch._grouped_mm loops over the groups there): the same sums as the per-expert reference."""
    x, logits, gate_up, down = _moe_inputs(n, 64, 32, 8, torch.float32, unused=2 if top_k < 6 else 0)
    args = (x, logits, gate_up, down, top_k, renormalize, fp32_weights, "silu")
    ref, fused = TorchMoE().forward(*args), FusedMoE(torch.device("cpu")).forward(*args)
    assert fused.shape == ref.shape == x.shape
    assert (fused - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_router_margin():
    logits = torch.tensor([[4.0, 1.0, 3.0, -8.0], [2.0, 2.0, 2.0, 1.0]])
    assert router_margin(logits, 2).tolist() == [(3.0 - 1.0) / 8.0, 0.0]  # k-th minus (k+1)-th over max |logit|
    assert router_margin(logits, 4).isinf().all()  # every expert chosen: nothing to tie with


def _margins(engine: Engine, prompts: List[List[int]]) -> np.ndarray:
    """Every position's smallest router margin over the MoE layers, through the driver's on_router hook."""
    seen: List[float] = []
    Driver(engine).generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), on_logits=lambda *a: None,
                            on_router=lambda uid, pos, m: seen.extend(m.amin(-1).tolist()))
    return np.array(seen)


def test_a_planted_router_near_tie_is_detected():
    """Layer 1's router row of expert 3 replaced by expert 0's times (1 + 1e-7): wherever the two are the k-th and
    (k+1)-th choices, the margin falls from about 0.1 to 1e-7, under parity's fp32 near-tie margin."""
    engine = Engine(EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                                 device="cpu", num_page_override=2048, max_seq_len_override=512,
                                 record_router_margins=True))
    try:
        prompts = _golden_sequences()
        before = _margins(engine, prompts)
        router = engine.model.model.layers[1].mlp.gate.weight
        router[3] = router[0] * (1 + 1e-7)
        after = _margins(engine, prompts)
    finally:
        engine.shutdown()
    tie, half = ROUTER_TIE["float32"], ROUTER_TIE["bfloat16"]
    print(f"positions under the margin {tie:g}: {(before <= tie).sum()} of {before.size} before, "
          f"{(after <= tie).sum()} after planting; median margin {np.median(before):.3g}; under bf16's {half:g}: "
          f"{(before <= half).mean():.0%}")
    assert before.size == after.size == sum(len(p) + 3 for p in prompts)
    assert (before <= tie).sum() == 0 and (after <= tie).sum() > 0


def test_router_near_ties_are_counted_and_reported_per_path(monkeypatch, tmp_path):
    """A planted margin (0.05 in fp32, where no router is near a tie) marks positions as router near ties: counted
    per prompt and path and reported, and parity still passes (their errors are within tol anyway)."""
    where = (MODEL, "cpu", "float32")
    import shutil

    shutil.copytree(G.golden_dir(*where), G.golden_dir(*where, root=tmp_path))
    monkeypatch.setitem(ROUTER_TIE, "float32", 0.05)  # the dict the gate reads
    result = run_parity(MODEL, paths=["batch"], golden_root=tmp_path)
    text = write_report(result, write_files=False)
    print(text)
    assert result.passed and result.router_tie == 0.05
    assert result.paths[0].router_near_ties == sum(p.router_near_ties for p in result.prompts) > 0
    assert "router_near_ties" in text


def _half_gate_inputs(moved: int = 0):
    """The bf16 golden of the MoE model judged on synthetic engine rows: KL 1e-3 and err 0.05 everywhere but at the
    golden's router near ties (KL 5, err 10: flipped experts) and at `moved` positions that are no near tie (the same
    damage). Returns (path, golden, stats, outputs, golden's near ties per prompt)."""
    gs = G.load(G.golden_dir(MODEL, "cuda", "bfloat16"))
    ties = {uid: set(gs.provenance["hf_router_near_ties"][pg.name]) for uid, pg in enumerate(gs.prompts)}
    stats = {}
    for uid, pg in enumerate(gs.prompts):
        n, rows = len(pg.prompt_ids), len(pg.prompt_ids) + len(pg.tokens) - 1
        clean = [pos for pos in range(rows) if pos not in ties[uid]]
        bad = ties[uid] | set(clean[:moved])
        stats[uid] = {pos: PositionStat(10.0 if pos in bad else 0.05, 5.0 if pos in bad else 1e-3, 0.0,
                                        int(pg.tokens[pos - n + 1]) if pos >= n - 1 else 0, np.zeros(1), np.zeros(1))
                      for pos in range(rows)}
    return next(p for p in PATHS if p.name == "batch"), gs, stats, [[] for _ in gs.prompts], ties


def test_half_gate_leaves_router_near_ties_out_and_keeps_its_teeth():
    """The bf16 gate of a MoE model: heavy damage at the golden's router near ties passes (flipped experts are
    luck, not a bug) where the all-position gate fails it; the same damage on 2% of the other positions fails;
    margins that make every position a near tie fail instead of emptying the gate."""
    path, gs, stats, outputs, ties = _half_gate_inputs()
    tol, limits = tolerance(gs, "bfloat16", moe=True), dist_limits(gs, "bfloat16", moe=True)
    no_tie = {uid: {pos: 1.0 for pos in rows} for uid, rows in stats.items()}
    prompts, result = evaluate(path, gs, stats, outputs, tol, tie_tolerance(tol, limits), limits, no_tie,
                               ROUTER_TIE["bfloat16"])
    left = sum(len([p for p in t if p in stats[uid]]) for uid, t in ties.items())
    print(f"{left} near ties left out; limits {limits}; stats {result.stats}")
    assert result.passed and all(p.passed for p in prompts) and result.left_out == left > 0
    assert result.positions + left == sum(len(rows) for rows in stats.values())
    dense_limits = dist_limits(gs, "bfloat16")  # every position, the limits from HF's spread over every position
    assert not evaluate(path, gs, stats, outputs, tol, None, dense_limits)[1].passed

    moved = max(1, int(0.02 * result.positions / len(stats)))
    path, gs, stats, outputs, _ = _half_gate_inputs(moved)
    _, result = evaluate(path, gs, stats, outputs, tol, None, limits, no_tie, ROUTER_TIE["bfloat16"])
    assert not result.passed and "kl_p99" in result.reason

    path, gs, stats, outputs, _ = _half_gate_inputs()
    all_ties = {uid: {pos: 0.0 for pos in rows} for uid, rows in stats.items()}
    _, result = evaluate(path, gs, stats, outputs, tol, None, limits, all_ties, ROUTER_TIE["bfloat16"])
    assert not result.passed and "router near ties left out" in result.reason, result.reason


def test_hf_spread_of_a_moe_model_leaves_router_near_ties_out(tmp_path):
    """A bf16 golden (on the CPU here, of the default set's first four text prompts, 12 new tokens each): the
    positions where none of HF's runs is a router near tie make the routed statistics, and the golden's own setting's
    near ties (sdpa at this thread count) are listed per prompt (its margins recomputed here agree); none of HF's
    settings is refuted for a flip."""
    from harness import hf_referee
    from harness import prompts as P

    ref = as_model(MODEL)
    four = [p for p in P.default_set(ref).prompts if "text" in p][:4]
    (tmp_path / "four.jsonl").write_text("".join(json.dumps({"prompt": p["text"], "name": p["name"],
                                                             "max_new_tokens": 12}) + "\n" for p in four))
    gs = G.make_golden(ref, "cpu", torch.bfloat16, P.read_file(tmp_path / "four.jsonl"))
    tie = ROUTER_TIE["bfloat16"]
    sdpa = G.hf_model(MODEL, "cpu", torch.bfloat16)
    with torch.inference_mode():
        own = {p.name: [q for q in np.nonzero(G.router_margins(
            sdpa(torch.tensor([s]), output_router_logits=True), len(s), sdpa.config.num_experts_per_tok) <= tie)[0]
            if q < len(s) - 1] for p, s in zip(gs.prompts, [list(p.prompt_ids) + list(p.tokens) for p in gs.prompts])}
    routed, every = gs.provenance["hf_spread_routed"], gs.provenance["hf_spread"]
    print(f"HF bf16 spread on the CPU: every position {every}; away from router near ties {routed}")
    assert routed["positions"] + routed["near_tie_positions"] == every["positions"] == sum(
        len(p.prompt_ids) + len(p.tokens) - 1 for p in gs.prompts)
    ties = gs.provenance["hf_router_near_ties"]
    assert routed["near_tie_positions"] >= max(map(len, ties.values())) > 0 and ties == own
    assert routed["kl_max"] <= every["kl_max"] and routed["router_tie"] == tie
    assert gs.provenance["hf_off"]["counts"] == {} and hf_referee.judge(gs, tie).spread_routed == routed


def test_half_gate_of_a_moe_golden_without_its_routed_spread_is_refused():
    gs = G.load(G.golden_dir(MODEL, "cuda", "bfloat16"))
    del gs.provenance["hf_spread_routed"]
    with pytest.raises(G.GoldenError, match="--refresh-spread"):
        dist_limits(gs, "bfloat16", moe=True)


# ------------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("n, experts, top_k, hidden, inter", [(1, 8, 2, 256, 128), (7, 8, 2, 256, 64),
                                                               (256, 128, 8, 2048, 768), (1, 128, 8, 2048, 768),
                                                               (4096, 128, 8, 2048, 384)])
def test_fused_against_the_reference_on_cuda_both_against_fp32(n, experts, top_k, hidden, inter):
    """torch._grouped_mm (bf16) and the torch reference (bf16) on identical inputs, each measured against the
    reference in fp32: the fused error at most 2x the reference's (they round differently, neither is exact)."""
    x, logits, gate_up, down = _moe_inputs(n, hidden, inter, experts, torch.float32, device="cuda")
    exact = TorchMoE().forward(x, logits, gate_up, down, top_k, True, False, "silu")
    half = tuple(t.bfloat16() for t in (x, logits, gate_up, down))
    ref = TorchMoE().forward(*half, top_k, True, False, "silu").float()
    fused = FusedMoE(torch.device("cuda")).forward(*half, top_k, True, False, "silu").float()
    # the bf16 routing may pick another expert than fp32 at a near tie: compare the tokens whose choice agrees
    same = (torch.topk(logits.bfloat16().float(), top_k).indices.sort().values ==
            torch.topk(logits, top_k).indices.sort().values).all(-1)
    err_ref, err_fused = ((t - exact)[same].abs().max().item() for t in (ref, fused))
    print(f"n {n} E {experts} k {top_k}: |ref - fp32| {err_ref:.3g}, |fused - fp32| {err_fused:.3g} "
          f"(scale {exact.abs().max().item():.3g}, {int(same.sum())} of {n} tokens)")
    assert err_fused <= 2 * err_ref + 1e-6


@pytest.mark.cuda
def test_fused_moe_in_a_cuda_graph_equals_eager():
    """Routing, sort, offsets and grouped GEMMs capture without a host sync; the replay is bitwise the eager run."""
    x, logits, gate_up, down = _moe_inputs(16, 256, 128, 8, torch.bfloat16, device="cuda")
    moe = FusedMoE(torch.device("cuda"))
    eager = moe.forward(x, logits, gate_up, down, 2, False, False, "silu")
    static_x, static_logits = x.clone(), logits.clone()
    moe.forward(static_x, static_logits, gate_up, down, 2, False, False, "silu")  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.forward(static_x, static_logits, gate_up, down, 2, False, False, "silu")
    x2, logits2, _, _ = _moe_inputs(16, 256, 128, 8, torch.bfloat16, device="cuda", seed=1)
    static_x.copy_(x2)
    static_logits.copy_(logits2)
    graph.replay()
    assert torch.equal(out, moe.forward(x2, logits2, gate_up, down, 2, False, False, "silu"))
    assert not torch.equal(out, eager)


@pytest.mark.cuda
@pytest.mark.parametrize("backend, graphs", [("auto", True), ("torch", False)])
def test_cuda_engine_chooses_the_moe_backend_and_graphs(backend, graphs):
    engine = Engine(EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 1),
                                 dtype=torch.bfloat16, num_page_override=1024, max_seq_len_override=256,
                                 max_running_req=8, moe_backend=backend))
    try:
        assert engine.config.moe_backend == ("fused" if backend == "auto" else "torch")
        assert bool(engine.config.cuda_graph_bs) == graphs
        prompts = _golden_sequences()[:3]
        out = Driver(engine).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        eager = Driver(engine, overlap=False).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert [r.output_ids for r in out] == [r.output_ids for r in eager]
    finally:
        engine.shutdown()


def test_bench_floor_counts_the_experts_a_step_touches():
    """The bench's bytes of a forward: the dense weights, plus per MoE layer the experts its tokens touch (top-k at
    one token, about all at a large batch); its FLOPs: each token's top-k experts only."""
    from harness.bench.limits import model_cost

    engine = Engine(EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                                 device="cpu", num_page_override=64, max_seq_len_override=64))
    try:
        cost = model_cost(engine)
        total = sum(p.numel() for p in engine.model.parameters()) * 4
    finally:
        engine.shutdown()
    expert = 3 * 256 * 128 * 4  # gate, up and down of one expert, fp32
    dense = total - 3 * 8 * expert
    assert (cost.expert_bytes, cost.moe_layers, cost.weight_bytes) == (expert, 3, dense)
    kv = cost.kv_bytes_per_token  # the token's own K and V, written
    assert cost.forward(1, 0, 0)[0] == dense + 3 * 2 * expert + kv
    assert 3 * 7.99 * expert < cost.forward(256, 0, 0)[0] - 256 * kv - dense <= 3 * 8 * expert
    assert cost.flops_per_token + cost.head_flops_per_row == 2 * (dense + 3 * 2 * expert) // 4
