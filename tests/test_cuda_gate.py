"""The bf16 parity gate on the GPU has teeth: faults of numerics HF does not have, of lengths and of scales, each
planted on one engine path, fail `harness parity --device cuda`, on a dense model and on the mixture-of-experts one
(whose gate leaves router near ties out); HF's own sdpa-vs-eager difference passes it."""

from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import pytest
import torch

from engine.attention.flashinfer_backend import FlashInferBackend
from engine.core import get_global_ctx
from engine.kernels import qk_rope_store
from harness import golden as G
from harness.compare import ROUTER_TIE, compare_row
from harness.parity.gate import dist_limits, evaluate, golden_row, tie_tolerance, tolerance
from harness.parity.paths import PATHS
from harness.parity.run import model_is_moe, run_parity

pytestmark = pytest.mark.cuda
MODELS = ("tiny-qwen3", "tiny-qwen3-moe")


def _extend_misses_its_newest_key(original: Callable) -> Callable:
    """Wrong length: a prefill over a cached prefix sees one key fewer (its attention entry one key short, on the
    eager and the graph path alike)."""
    def entries(self, batch):
        kv_lens, ext, rows = original(self, batch)
        if batch.is_prefill:
            kv_lens = [kv - 1 if i < len(batch.padded_reqs) and batch.padded_reqs[i].cached_len > 0 else kv
                       for i, kv in enumerate(kv_lens)]
        return [kv_lens, ext, rows]
    return entries


def _graph_decode_scale(original: Callable) -> Callable:
    """Wrong scale: the decode graphs are captured with a softmax scale 1.25 x too large."""
    def capture(self, batch):
        self.sm_scale *= 1.25
        try:
            return original(self, batch)
        finally:
            self.sm_scale /= 1.25
    return capture


def _paged_keys_in_fp8(original: Callable) -> Callable:
    """Numerics HF does not have: with pages of 16 tokens, keys are stored through fp8 (e4m3)."""
    def store(positions, q, kv, table, q_weight, k_weight, eps, k_pool, v_pool, out_loc):
        original(positions, q, kv, table, q_weight, k_weight, eps, k_pool, v_pool, out_loc)
        if get_global_ctx().page_size > 1:
            k_pool[out_loc] = k_pool[out_loc].to(torch.float8_e4m3fn).to(k_pool.dtype)
    return store


def _rope_positions_in_bf16(original: Callable) -> Callable:
    """Numerics HF does not have: positions rounded to bf16 before the rotary lookup (exact up to 256), in the
    single-request path's batches of one."""
    def store(positions, *args):
        if len(get_global_ctx().batch.reqs) == 1:
            positions = positions.to(torch.bfloat16).to(positions.dtype)
        return original(positions, *args)
    return store


FAULTS: Dict[str, tuple] = {  # name -> (owner, attribute, wrapper, the one path it lives on)
    "extend misses its newest key": (FlashInferBackend, "_entries", _extend_misses_its_newest_key, "prefix"),
    "decode graphs with 1.25 x the softmax scale": (FlashInferBackend, "prepare_for_capture", _graph_decode_scale,
                                                    "batch"),
    "paged keys through fp8": (qk_rope_store, "qk_rope_store", _paged_keys_in_fp8, "paged"),
    "rope positions rounded to bf16": (qk_rope_store, "qk_rope_store", _rope_positions_in_bf16, "single"),
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_bf16_fault_fails_parity_on_its_path(monkeypatch, fault, model):
    cls, attr, wrap, path = FAULTS[fault]
    assert run_parity(model, "cuda", "bfloat16", paths=[path]).passed  # the path passes without the fault
    monkeypatch.setattr(cls, attr, wrap(getattr(cls, attr)))
    result = run_parity(model, "cuda", "bfloat16", paths=[path])
    caught = [p.reason for p in result.prompts if not p.passed][:2] + [p.reason for p in result.paths if not p.passed]
    print(f"{fault} on {path}: {'caught: ' + '; '.join(caught) if caught else 'NOT caught'}; "
          f"path stats {result.paths[0].stats} limits {result.paths[0].limits}")
    assert not result.passed


@pytest.mark.parametrize("model", MODELS)
def test_hf_eager_against_the_sdpa_golden_passes_the_gate(model):
    """HF's own attention switch, teacher-forced on the golden's sequences and judged like an engine path (with
    eager's own router margins on the MoE model)."""
    from harness.golden import hf_model

    gs = G.load_checked(model, "cuda", "bfloat16")
    eager = hf_model(model, "cuda", torch.bfloat16, attn="eager")
    moe = model_is_moe(model)
    stats, outputs, margins = {}, [], {}
    with torch.inference_mode():
        for uid, pg in enumerate(gs.prompts):
            seq = torch.from_numpy(np.concatenate([pg.prompt_ids, pg.tokens[:-1]]).astype(np.int64))[None].cuda()
            out = eager(seq, **({"output_router_logits": True} if moe else {}))
            lp = torch.log_softmax(out.logits[0].float(), -1).cpu()
            stats[uid] = {i: compare_row(lp[i], *golden_row(pg, i)) for i in range(lp.shape[0])}
            outputs.append([])
            if moe:
                m = G.router_margins(out, lp.shape[0], eager.config.num_experts_per_tok)
                margins[uid] = dict(enumerate(m.tolist()))
    tol, limits = tolerance(gs, "bfloat16", moe), dist_limits(gs, "bfloat16", moe)
    path = next(p for p in PATHS if p.name == "batch")  # teacher-forced, every position compared
    prompts, result = evaluate(path, gs, stats, outputs, tol, tie_tolerance(tol, limits), limits,
                               margins if moe else None, ROUTER_TIE["bfloat16"])
    print(f"HF eager vs sdpa golden: {result.stats} limits {result.limits}, {result.left_out} near ties left out")
    assert result.passed and all(p.passed for p in prompts), [p.reason for p in prompts if not p.passed]
