"""Tensor parallelism on the CPU over gloo, one process per rank (harness/tp.py), against TP=1 in this process.

Worlds (each spawned once per module, its ranks run several engines one after another):
    tiny-qwen3         TP=2  4 q / 2 KV heads: 2 q + 1 KV per rank
    smollm2-135m       TP=3  9 q / 3 KV heads: 3 q + 1 KV per rank (TP=2 does not divide 9: a clear error)
    tiny-qwen3-untied  TP=4  2 KV heads replicated over 4 ranks (allow_replicate), untied vocab-parallel LM head
    tiny-qwen3-moe     TP=2  8 experts split along their intermediate dimension (64 of 128 per rank), the router
                             replicated, one all-reduce per MoE layer
Each world also checks vocab-parallel padding with a vocabulary its TP size does not divide (49152 is divisible
by 2, 3 and 4, so the real models never pad). Every world reuses one port for all its engines, and its last step
joins a new world the moment the previous Engine is shut down: before engine/distributed.py owned rank 0's
rendezvous server, that step read the previous world's store keys and timed out (gloo connectFullMesh).

Logit tolerance: REL_TOL x the largest |logit| (the same bound as tests/test_engine.py's batched-vs-HF check). The
row-parallel layers split each GEMM's reduction into TP partial sums that gloo adds in another order, so the logits
move by fp32 rounding only. Measured max |TP - TP1| over every prefill and decode position (4 prompts, 12 tokens):
tiny-qwen3 TP=2 1.11e-4 (|logit| <= 89.8, 1.2e-6 relative; tol 9.0e-4), smollm2 TP=3 1.16e-4 (|logit| <= 41.8,
2.8e-6 relative; tol 4.2e-4), tiny-qwen3-untied TP=4 1.22e-4 (|logit| <= 84.9, 1.4e-6 relative; tol 8.5e-4). A real
sharding bug moves logits by O(1): KV heads replicated to the wrong ranks moved them by 115.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.tp import TPLaunchError, TPRun, build_engine, generate_on_rank, launch
from tests.conftest import PROMPTS

REL_TOL = 1e-5
NEW_TOKENS = 12
WORLD_TIMEOUT = 300.0  # a world that hangs is killed by the launcher and fails its tests
ENGINE_TIMEOUT = 30.0  # distributed_timeout inside the worlds
REPO = Path(__file__).resolve().parent.parent


def _prompt_ids(model: str) -> List[List[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(zoo.prepare(model))
    return [tok(p).input_ids for p in PROMPTS]


def _greedy_run(model: str, prompts: List[List[int]]) -> TPRun:
    return TPRun(str(zoo.path(model)), prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                 engine_kwargs={"distributed_timeout": ENGINE_TIMEOUT}, record_logits=True)


# ------------------------------------------------------------------------------------ what the ranks run (spawned)
def _step(out: Dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one part of a world; a failure is reported to its test instead of failing the whole world."""
    try:
        out[name] = fn()
    except Exception:
        out[name] = {"error": traceback.format_exc()}


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _sampling(rank: int, size: int, port: int, path: str, prompts: List[List[int]]) -> Dict[str, Any]:
    """A second engine in the same processes, on the same port (the first one's teardown freed it)."""
    from engine.sample import BatchSamplingArgs
    from harness.driver import Driver

    engine = build_engine(rank, size, port, path, distributed_timeout=ENGINE_TIMEOUT)
    try:
        res: Dict[str, Any] = {"initialized": dist.is_initialized(), "port_in_use": _port_in_use(port)}
        torch.manual_seed(1000 + rank)  # deliberately different on every rank
        vocab = engine.config.model_config.vocab_size
        # the ranks' own draws, not broadcast: different RNG streams draw different tokens
        res["local_draws"] = engine.sampler.sample(torch.zeros(16, vocab), BatchSamplingArgs(torch.ones(16))).tolist()
        params = [SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, ignore_eos=True),
                  SamplingParams(temperature=1.5, top_k=50, min_p=0.01, max_tokens=NEW_TOKENS, ignore_eos=True),
                  SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)]  # greedy, in a mixed batch
        res["tokens"] = [r.output_ids for r in Driver(engine).generate(prompts, params)]
    finally:
        engine.shutdown()
    res["initialized_after_shutdown"] = dist.is_initialized()
    return res


FAKE_FREE_UNIT = 64 << 20


def _memory_plan(rank: int, size: int, port: int, path: str) -> Dict[str, Any]:
    """A third engine, planning its own KV pool: each rank is told it has a different amount of free memory."""
    import engine.engine as engine_module
    import engine.utils.device as device_module

    fake = lambda device: (size - rank) * FAKE_FREE_UNIT  # noqa: E731  rank 0 has the most, the last rank the least
    saved = engine_module.free_memory, device_module.free_memory
    engine_module.free_memory = device_module.free_memory = fake
    try:
        engine = build_engine(rank, size, port, path, distributed_timeout=ENGINE_TIMEOUT, num_page_override=None)
    finally:
        engine_module.free_memory, device_module.free_memory = saved
    try:
        return {"num_pages": engine.num_pages, "init_free": engine.plan.init_free,
                "bytes_per_page": engine.plan.bytes_per_page, "capped_by": engine.plan.capped_by}
    finally:
        engine.shutdown()


def _vocab_padding(rank: int, size: int, port: int, vocab: int) -> Dict[str, Any]:
    """VocabParallelEmbedding and the LM head over a vocabulary the TP size does not divide, through the loader's
    sharding (models/weights.py) and real collectives."""
    from engine.distributed import destroy_process_groups, init_process_groups, set_tp_info
    from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
    from engine.layers.ops import TorchOps
    from engine.models.weights import _shard

    set_tp_info(rank, size)
    init_process_groups(DistributedInfo(rank, size), torch.device("cpu"), f"tcp://127.0.0.1:{port}", ENGINE_TIMEOUT)
    try:
        gen = torch.Generator().manual_seed(0)
        full = torch.randn(vocab, 8, generator=gen)
        hidden = torch.randn(5, 8, generator=gen)
        cfg = SimpleNamespace(vocab_size=vocab, num_kv_heads=1)
        emb, head = VocabParallelEmbedding(vocab, 8), ParallelLMHead(vocab, 8)
        emb.load_state_dict({"weight": _shard("model.embed_tokens.weight", "embed_tokens", full, cfg)}, assign=True)
        head.load_state_dict({"weight": _shard("lm_head.weight", "lm_head", full, cfg)}, assign=True)
        ids = torch.arange(vocab, dtype=torch.int32).flip(0)
        logits = compute_logits(hidden, head.weight, vocab, TorchOps())
        per_rank = head.weight.shape[0]
        real = max(0, min(per_rank, vocab - rank * per_rank))  # this rank's rows that are not padding
        return {"rows": per_rank, "start": emb.start, "padding_zero": bool((head.weight[real:] == 0).all()),
                "mine_exact": bool(torch.equal(head.weight[:real], full[rank * per_rank: rank * per_rank + real])),
                "embed_err": (emb(ids) - full[ids.long()]).abs().max().item(),
                "logits_shape": tuple(logits.shape), "logits_err": (logits - hidden @ full.T).abs().max().item()}
    finally:
        destroy_process_groups()


def _world(rank: int, size: int, port: int, greedy: TPRun, extra: List[str], vocab: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    _step(out, "greedy", lambda: generate_on_rank(rank, size, port, greedy))
    out["initialized_after_greedy"] = dist.is_initialized()
    if "sampling" in extra:
        _step(out, "sampling", lambda: _sampling(rank, size, port, greedy.model_path, greedy.prompts))
    if "memory" in extra:
        _step(out, "memory", lambda: _memory_plan(rank, size, port, greedy.model_path))
    _step(out, "vocab", lambda: _vocab_padding(rank, size, port, vocab))
    return out


# ------------------------------------------------------------------------------------------------- the worlds
def _run_world(model: str, tp: int, extra: List[str], vocab: int) -> SimpleNamespace:
    run = _greedy_run(model, _prompt_ids(model))
    t0 = time.perf_counter()
    ref = generate_on_rank(0, 1, 0, run)  # TP=1, here
    t1 = time.perf_counter()
    ranks = launch(_world, tp, run, extra, vocab, timeout=WORLD_TIMEOUT)
    t2 = time.perf_counter()
    print(f"\n{model}: TP=1 {t1 - t0:.1f} s, TP={tp} world {t2 - t1:.1f} s")
    return SimpleNamespace(model=model, tp=tp, vocab=vocab, ref=ref, ranks=ranks)


@pytest.fixture(scope="module")
def tiny_tp2() -> SimpleNamespace:
    return _run_world("tiny-qwen3", 2, ["sampling", "memory"], vocab=9)


@pytest.fixture(scope="module")
def smollm2_tp3() -> SimpleNamespace:
    return _run_world("smollm2-135m", 3, [], vocab=10)


@pytest.fixture(scope="module")
def untied_tp4() -> SimpleNamespace:
    return _run_world("tiny-qwen3-untied", 4, [], vocab=5)


@pytest.fixture(scope="module")
def moe_tp2() -> SimpleNamespace:
    return _run_world("tiny-qwen3-moe", 2, [], vocab=7)


def _part(rank_out: Dict[str, Any], name: str) -> Any:
    part = rank_out[name]
    assert not (isinstance(part, dict) and "error" in part), f"{name} failed on a rank:\n{part['error']}"
    return part


def _check_parity(world: SimpleNamespace) -> None:
    ref = world.ref
    scale = max(t.abs().max().item() for t in ref.logits.values())
    for rank, out in enumerate(world.ranks):
        got = _part(out, "greedy")
        assert [r.output_ids for r in got.results] == [r.output_ids for r in ref.results], f"rank {rank}"
        err = 0.0
        for uid, want in ref.logits.items():
            assert got.logits[uid].shape == want.shape
            err = max(err, (got.logits[uid] - want).abs().max().item())
        print(f"{world.model} TP={world.tp} rank {rank}: max |logit - TP1| = {err:.3g} (max |logit| {scale:.1f}, "
              f"tol {REL_TOL * scale:.3g})")
        assert err < REL_TOL * scale
        assert got.num_pages == ref.num_pages and got.max_seq_len == ref.max_seq_len
        assert not out["initialized_after_greedy"], "Engine.shutdown left the process group up"


def _check_vocab(world: SimpleNamespace) -> None:
    tp, vocab = world.tp, world.vocab
    per_rank = -(-vocab // tp)
    assert vocab % tp != 0
    for rank, out in enumerate(world.ranks):
        v = _part(out, "vocab")
        assert v["rows"] == per_rank and v["start"] == rank * per_rank
        assert v["padding_zero"] and v["mine_exact"]
        assert v["logits_shape"] == (5, vocab)
        assert v["embed_err"] == 0.0  # one nonzero term per row: exact
        assert v["logits_err"] < 1e-5


# --------------------------------------------------------------------------------------------------- the tests
def test_tiny_qwen3_tp2_matches_tp1(tiny_tp2):
    _check_parity(tiny_tp2)


def test_smollm2_tp3_matches_tp1(smollm2_tp3):
    _check_parity(smollm2_tp3)


def test_tiny_qwen3_untied_tp4_replicated_kv_heads_matches_tp1(untied_tp4):
    _check_parity(untied_tp4)


def test_tiny_qwen3_moe_tp2_matches_tp1(moe_tp2):
    _check_parity(moe_tp2)


@pytest.mark.parametrize("world", ["tiny_tp2", "smollm2_tp3", "untied_tp4", "moe_tp2"])
def test_vocab_not_divisible_by_tp_is_padded(world, request):
    _check_vocab(request.getfixturevalue(world))


def test_sampled_tokens_agree_across_ranks_with_different_seeds(tiny_tp2):
    parts = [_part(out, "sampling") for out in tiny_tp2.ranks]
    draws = [p["local_draws"] for p in parts]
    assert draws[0] != draws[1], "the ranks' RNGs were meant to differ"
    assert parts[0]["tokens"] == parts[1]["tokens"]  # rank 0's draws, broadcast
    greedy = [r.output_ids for r in tiny_tp2.ref.results]
    assert parts[0]["tokens"][3] == greedy[3]  # the greedy row of the mixed batch
    assert parts[0]["tokens"][:3] != greedy[:3]  # the sampled rows did sample


def test_second_engine_in_same_processes_and_port_honoured(tiny_tp2):
    """The sampling engine started after the greedy one in the same two processes, on the same port."""
    for rank, out in enumerate(tiny_tp2.ranks):
        p = _part(out, "sampling")
        assert p["initialized"] and not p["initialized_after_shutdown"]
        if rank == 0:
            assert p["port_in_use"], "rank 0's rendezvous store should listen on distributed_port"


def test_memory_plan_takes_the_minimum_over_ranks(tiny_tp2):
    parts = [_part(out, "memory") for out in tiny_tp2.ranks]
    least = FAKE_FREE_UNIT  # the last rank's
    assert all(p["init_free"] == least for p in parts)
    expected = int(0.9 * least) // parts[0]["bytes_per_page"]  # memory_ratio 0.9, nothing loaded per the fake
    assert [p["num_pages"] for p in parts] == [expected] * 2
    assert parts[0]["capped_by"] == "memory_ratio"


def test_tp1_creates_no_process_group():
    eng = build_engine(0, 1, 0, str(zoo.prepare("tiny-qwen3")))
    try:
        assert not dist.is_initialized()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("model, tp, message", [
    ("smollm2-135m", 2, "9 is not divisible by TP size 2"),
    ("tiny-qwen3", 3, "4 is not divisible by TP size 3"),
    ("tiny-qwen3", 8, "4 is not divisible by TP size 8"),
])
def test_tp_not_dividing_heads_is_a_clear_error(model, tp, message):
    """Checked before any rendezvous: every rank fails at once, alone, without waiting for its peers."""
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(model_path=str(zoo.prepare(model)), tp_info=DistributedInfo(0, tp),
                            dtype=torch.float32, device="cpu", distributed_timeout=1.0))
    assert not dist.is_initialized()


_LONE_RANK = textwrap.dedent("""
    import sys, time
    from harness import zoo
    from harness.tp import build_engine, free_port
    rank, timeout = int(sys.argv[1]), float(sys.argv[2])
    t = time.monotonic()
    try:
        build_engine(rank, 2, free_port(), str(zoo.path("tiny-qwen3")), distributed_timeout=timeout)
    except RuntimeError as e:
        print(f"RAISED {time.monotonic() - t:.1f} {e}")
        sys.exit(0)
    print("STARTED without its peer")
    sys.exit(1)
""")


def test_a_rank_alone_raises_instead_of_hanging():
    """Rank 0 alone (its store waits for rank 1) and rank 1 alone (nobody listens): both give up. A subprocess with
    its own timeout, so this test cannot hang. Measured with distributed_timeout=3: rank 0 after ~4 s, rank 1 after
    6-15 s (torch's TCPStore client retries its connect: 1-3 x the timeout)."""
    timeout = 3.0
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {rank: subprocess.Popen([sys.executable, "-c", _LONE_RANK, str(rank), str(timeout)], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)}
    for rank, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail(f"rank {rank} alone still waiting after 90 s (distributed_timeout={timeout})")
        line = next((ln for ln in stdout.splitlines() if ln.startswith(("RAISED", "STARTED"))), "")
        assert p.returncode == 0 and line.startswith("RAISED"), f"rank {rank}: {stdout}\n{stderr[-2000:]}"
        elapsed = float(line.split()[1])
        print(f"rank {rank} alone: raised after {elapsed} s: {line[:300]}")
        assert elapsed < 4 * timeout + 10
        assert f"TP rank {rank} of 2 could not join the TP world" in line


def _fail_after_rendezvous(rank: int, size: int, port: int, path: str) -> str:
    if rank == 1:
        import engine.models.weights as weights

        def broken(_path: Any) -> Any:
            raise RuntimeError("injected: rank 1 cannot read its checkpoint")

        weights._iter_safetensors = broken
    build_engine(rank, size, port, path, distributed_timeout=60.0)
    return "started"


def test_a_rank_failing_after_rendezvous_fails_the_others_fast():
    """Rank 1 fails while loading (the world is joined, rank 0 waits in the memory all-reduce): its failed start tears
    its groups down at once, so rank 0 fails within seconds, not after distributed_timeout=60 s."""
    t = time.monotonic()
    with pytest.raises(TPLaunchError) as info:
        launch(_fail_after_rendezvous, 2, str(zoo.prepare("tiny-qwen3")), timeout=120.0, grace=90.0)
    elapsed = time.monotonic() - t
    print(f"both ranks failed after {elapsed:.1f} s")
    assert "injected: rank 1 cannot read its checkpoint" in info.value.failures[1]
    assert "Connection closed by peer" in info.value.failures[0] or "Connection reset" in info.value.failures[0]
    assert elapsed < 30.0
