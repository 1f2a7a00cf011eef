"""The engine on CPU in fp32 against HF: prefill logits, greedy tokens, page sizes, batching, cached prefixes."""

from __future__ import annotations

from typing import List

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import Batch, Req, SamplingParams
from engine.distributed import DistributedInfo
from harness.driver import Driver
from tests.conftest import PROMPTS

# Relative to the largest |logit|. Observed on one prompt at a time: 0 (the same kernels as HF, same shapes). In a
# packed batch the GEMMs see another number of rows and accumulate in another order: 1.2e-4 on SmolLM2 (|logit| <= 36,
# 3.5e-6 relative) and 1.4e-4 on tiny-qwen3 (|logit| <= 76, 1.9e-6 relative), about 30 fp32 ulps of the logit scale.
REL_TOL = 1e-5


def prefill_logits(engine: Engine, prompts: List[List[int]], cached: List[int] | None = None) -> torch.Tensor:
    """All-position logits of one prefill batch; rows [0, len) of each page-table row hold its KV slots."""
    reqs = []
    for row, ids in enumerate(prompts):
        engine.page_table[row, :512] = torch.arange(row * 512, row * 512 + 512)
        reqs.append(Req(torch.tensor(ids, dtype=torch.int32), row, cached[row] if cached else 0, 1, row,
                        SamplingParams(), None))
    batch = Batch(reqs=reqs, phase="prefill", return_logits="all")
    engine.graph_runner.pad_batch(batch)
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs]).int()
    batch.input_ids = torch.cat([r.input_ids[r.cached_len:r.device_len] for r in reqs])
    batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len:r.device_len] for r in reqs])
    engine.attn_backend.prepare_metadata(batch)
    return engine.forward_batch(batch, engine.sampler.prepare(batch)).logits


def test_prefill_logits_match_hf(model_name, hf, make_engine):
    model, tok = hf
    ids = [tok(p).input_ids for p in PROMPTS]
    engine = make_engine()
    logits = prefill_logits(engine, ids)
    ref = torch.cat([model(torch.tensor([i])).logits[0] for i in ids])
    err = (logits - ref).abs().max().item()
    print(f"{model_name}: max |engine - HF| prefill logit = {err:.3g} (max |logit| {ref.abs().max():.1f})")
    assert err < REL_TOL * ref.abs().max().item()
    single = prefill_logits(engine, ids[:1])
    print(f"{model_name}: one prompt alone: {(single - ref[: len(ids[0])]).abs().max().item():.3g}")


@pytest.mark.parametrize("page_size", [1, 5])
def test_greedy_16_tokens_match_hf_generate(model_name, hf, make_engine, page_size):
    """page_size 5 puts every prompt across page boundaries, at offsets that differ between prompts."""
    model, tok = hf
    ids = [tok(p).input_ids for p in PROMPTS]
    out = Driver(make_engine(page_size=page_size)).generate(ids, SamplingParams(max_tokens=16, ignore_eos=True))
    for i, r in zip(ids, out):
        ref = model.generate(torch.tensor([i]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert r.output_ids == ref[0, len(i):].tolist()


def test_batch_equals_each_prompt_alone(model_name, hf, make_engine):
    _, tok = hf
    ids = [tok(p).input_ids for p in PROMPTS]
    driver = Driver(make_engine(page_size=4))
    together = driver.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    alone = [driver.generate([i], SamplingParams(max_tokens=12, ignore_eos=True))[0] for i in ids]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]


def test_cached_prefix_plus_extend_equals_one_prefill(model_name, hf, make_engine):
    _, tok = hf
    ids = [tok(p).input_ids for p in PROMPTS]
    engine = make_engine()
    whole = prefill_logits(engine, ids)
    split = [len(i) // 2 for i in ids]
    prefill_logits(engine, [i[:s] for i, s in zip(ids, split)])  # writes the prefixes' KV
    extend = prefill_logits(engine, ids, cached=split)  # extends over them
    rows = torch.cat([torch.arange(sum(map(len, ids[:k])) + s, sum(map(len, ids[:k + 1])))
                      for k, s in enumerate(split)])
    assert (extend - whole[rows]).abs().max().item() < REL_TOL * whole.abs().max().item()


def test_decode_logits_match_a_full_prefill(model_name, hf, make_engine):
    """Paged decode reads back what prefill wrote: the last decode step equals a prefill of the whole sequence."""
    _, tok = hf
    ids = tok(PROMPTS[3]).input_ids
    engine = make_engine(page_size=3)
    seen = {}
    Driver(engine).generate([ids], SamplingParams(max_tokens=6, ignore_eos=True),
                            on_logits=lambda uid, pos, lp: seen.update({pos + i: lp[i] for i in range(len(lp))}))
    out = Driver(engine).generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_ids
    full = torch.log_softmax(prefill_logits(engine, [ids + out[:5]]), -1)
    last = len(ids) + 4
    assert (seen[last] - full[last]).abs().max().item() < REL_TOL * full.abs().max().item()


def test_two_engines_one_after_another(model_name, make_engine):
    first = make_engine()
    with pytest.raises(RuntimeError, match="already live"):
        make_engine()
    first.shutdown()
    second = make_engine()  # starts clean: shutdown (and the failed start above) left no global state
    assert second.num_pages == 2048


def test_qwen2_with_qkv_bias_matches_hf(tmp_path):
    """Qwen2 (bias on q/k/v, no q/k norm) through the same decoder: a small random model made here."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.5, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    hf = Qwen2ForCausalLM(cfg).eval()
    for layer in hf.model.layers:  # HF zero-initializes biases: make them matter
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp_path)
    _prefill_matches_hf(tmp_path, hf)


def test_mixtral_moe_matches_hf(tmp_path):
    """Mixtral through the same decoder: block_sparse_moe.experts.<e>.w1/w3/w2 mapped at load, every layer sparse,
    the top-k always renormalized and the expert outputs weighted in fp32. A small random model made here."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=512, initializer_range=0.5, tie_word_embeddings=False,
                        architectures=["MixtralForCausalLM"])
    hf = MixtralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    mc = _prefill_matches_hf(tmp_path, hf)
    assert mc.router_weights_fp32 and mc.norm_topk_prob


def _prefill_matches_hf(folder, hf):
    """The engine's prefill logits of two prompts from the saved HF model in folder against HF's own, fp32 on the CPU;
    returns the engine's ModelConfig."""
    engine = Engine(EngineConfig(model_path=str(folder), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                                 device="cpu", num_page_override=2048, max_seq_len_override=512))
    try:
        ids = [[5, 17, 300, 42, 7, 99], [1, 2, 3]]
        logits = prefill_logits(engine, ids)
        with torch.no_grad():
            ref = torch.cat([hf(torch.tensor([i])).logits[0] for i in ids])
        assert (logits - ref).abs().max().item() < REL_TOL * ref.abs().max().item()
        return engine.config.model_config
    finally:
        engine.shutdown()
