"""Shared fixtures: zoo models prepared once per session; GPU tests skip without CUDA."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, List

# before torch loads its BLAS and OpenMP, as python -m harness does (docs/parity-determinism.md)
os.environ.update({"MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"})
from engine.utils.threads import MKL_CNR  # noqa: E402 (loads torch: after the environment its OpenMP reads)

os.environ.setdefault("MKL_CBWR", MKL_CNR)  # read when MKL first computes

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter, on CPU tensors (read when Triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import Engine, EngineConfig
from engine.distributed import DistributedInfo
from harness import golden as G
from harness import zoo

MODELS = ["smollm2-135m", "tiny-qwen3", "tiny-qwen3-moe"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Les mathématiques sont",
           "Once upon a time in a land far away, there lived a"]


@pytest.hookimpl(tryfirst=True)  # before -m selects: on a GPU, `-m cuda` takes the "devices" tests as well
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if torch.cuda.is_available():
        for item in items:
            if "devices" in item.keywords:
                item.add_marker(pytest.mark.cuda)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", params=MODELS)
def model_name(request: pytest.FixtureRequest) -> str:
    zoo.prepare(request.param)
    return request.param


@pytest.fixture
def golden_copy(tmp_path: Path) -> Path:
    """A golden root holding a private copy of tiny-qwen3's CPU golden: to damage freely, and where a failing parity
    run writes the engine's result (golden.obtained.*) instead of beside the committed golden."""
    model, device, dtype = "tiny-qwen3", "cpu", "float32"
    shutil.copytree(G.golden_dir(model, device, dtype), G.golden_dir(model, device, dtype, tmp_path))
    return tmp_path


@pytest.fixture(scope="session")
def hf_cache() -> dict:
    return {}


@pytest.fixture
def hf(model_name: str, hf_cache: dict):
    """The HF model and tokenizer, fp32 on the CPU, loaded once per model."""
    if model_name not in hf_cache:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = zoo.path(model_name)
        hf_cache[model_name] = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                                AutoTokenizer.from_pretrained(path))
    return hf_cache[model_name]


@pytest.fixture
def make_engine(model_name: str) -> Iterator[Callable[..., Engine]]:
    """Build engines on the current model; each is shut down after the test."""
    engines: List[Engine] = []

    def make(**kw) -> Engine:
        kw.setdefault("num_page_override", 2048)
        kw.setdefault("max_seq_len_override", 512)
        kw.setdefault("max_running_req", 8)
        eng = Engine(EngineConfig(model_path=str(zoo.path(model_name)), tp_info=DistributedInfo(0, 1),
                                  dtype=torch.float32, device="cpu", **kw))
        engines.append(eng)
        return eng

    yield make
    for e in engines:
        if e.model is not None:
            e.shutdown()
