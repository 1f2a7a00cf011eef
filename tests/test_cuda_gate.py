"""The bf16 parity gate on the GPU has teeth: faults of numerics HF does not have, of lengths and of scales, each
planted on one engine path, fail `harness parity --device cuda`; HF's own sdpa-vs-eager difference passes it."""

from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import pytest
import torch

from engine.attention.flashinfer_backend import FlashInferBackend
from engine.core import get_global_ctx
from engine.layers import qk_rope_store
from harness import golden as G
from harness.compare import compare_row
from harness.parity.gate import dist_limits, evaluate, golden_row, tie_tolerance, tolerance
from harness.parity.paths import PATHS
from harness.parity.run import run_parity

pytestmark = pytest.mark.cuda
MODEL = "tiny-qwen3"


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


@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_bf16_fault_fails_parity_on_its_path(monkeypatch, fault):
    cls, attr, wrap, path = FAULTS[fault]
    assert run_parity(MODEL, "cuda", "bfloat16", paths=[path]).passed  # the path passes without the fault
    monkeypatch.setattr(cls, attr, wrap(getattr(cls, attr)))
    result = run_parity(MODEL, "cuda", "bfloat16", paths=[path])
    caught = [p.reason for p in result.prompts if not p.passed][:2] + [p.reason for p in result.paths if not p.passed]
    print(f"{fault} on {path}: {'caught: ' + '; '.join(caught) if caught else 'NOT caught'}; "
          f"path stats {result.paths[0].stats} limits {result.paths[0].limits}")
    assert not result.passed


def test_hf_eager_against_the_sdpa_golden_passes_the_gate():
    """HF's own attention switch, teacher-forced on the golden's sequences and judged like an engine path."""
    from harness.golden import hf_model

    gs = G.load_checked(MODEL, "cuda", "bfloat16")
    eager = hf_model(MODEL, "cuda", torch.bfloat16, attn="eager")
    stats, outputs = {}, []
    with torch.inference_mode():
        for uid, pg in enumerate(gs.prompts):
            seq = torch.from_numpy(np.concatenate([pg.prompt_ids, pg.tokens[:-1]]).astype(np.int64))[None].cuda()
            lp = torch.log_softmax(eager(seq).logits[0].float(), -1).cpu()
            stats[uid] = {i: compare_row(lp[i], *golden_row(pg, i)) for i in range(lp.shape[0])}
            outputs.append([])
    tol, limits = tolerance(gs, "bfloat16"), dist_limits(gs, "bfloat16")
    path = next(p for p in PATHS if p.name == "batch")  # teacher-forced, every position compared
    prompts, result = evaluate(path, gs, stats, outputs, tol, tie_tolerance(tol, limits), limits)
    print(f"HF eager vs sdpa golden: {result.stats} limits {result.limits}")
    assert result.passed and all(p.passed for p in prompts), [p.reason for p in prompts if not p.passed]
