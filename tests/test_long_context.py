"""The CI gate at long context: SmolLM2 against its long-context golden (golden/long-context/: two prompts of 4,000+
tokens of real text, every position), along the two paths that reach what only a long prompt has.

- `batch`: each prompt one prefill of 4,000+ tokens (positions and attention spans six times the default set's), then
  decode with the whole prompt in the KV cache;
- `chunked`, with 256-token chunks: each prompt arrives in 16 extends over its own cached prefix, which grows to
  4,000+ tokens across pages of 4, while the other prompt decodes between its chunks. The parity path's own 5-token
  chunks (about 800 a prompt, several CPU minutes) add only smaller chunks, which the default set's gate
  (tests/test_parity.py) already covers; `nox -s parity-long` runs them here too.

The other paths add nothing at this length that these two miss (single and paged: batch's prefill alone or on larger
pages; prefix and continuous: extends, as chunked's; free: the engine's own 16 tokens), and run in `nox -s parity-long`
with gemma3-270m's long-context golden (past its sliding window), which needs a 238 MB download first.

On a GPU (`cuda`), every GPU path runs against the GPU long-context goldens (bf16 and fp32, made on the card), the
5-token chunks included: there they cost seconds.
"""

from __future__ import annotations

import dataclasses

import pytest

from harness import golden as G
from harness.models import GOLDEN_DIR
from harness.parity import run
from harness.parity.paths import PATHS
from harness.parity.report import write_report

LONG_CONTEXT = GOLDEN_DIR / "long-context"
CHUNK = 256


def _long_context_paths() -> tuple:
    by_name = {p.name: p for p in PATHS}
    chunked = dataclasses.replace(by_name["chunked"], max_prefill_tokens=CHUNK,
                                  description=f"{CHUNK}-token prefill budget: each prompt prefilled in chunks, each an "
                                              "extend over its own cached prefix, the other decoding between them")
    return by_name["batch"], chunked


def test_smollm2_matches_long_context_golden(monkeypatch):
    gs = G.load_checked("smollm2-135m", "cpu", "float32", LONG_CONTEXT)
    assert len(gs.prompts) >= 2 and min(len(p.prompt_ids) for p in gs.prompts) >= 4000
    monkeypatch.setattr(run, "PATHS", _long_context_paths())
    result = run.run_parity("smollm2-135m", golden_root=LONG_CONTEXT)
    print(write_report(result, write_files=False))
    assert result.passed, write_report(result, write_files=False)
    assert {p.path for p in result.paths} == {"batch", "chunked"}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smollm2_matches_long_context_golden_on_cuda(dtype):
    """Every GPU path against the GPU long-context golden (made on the card: `golden --device cuda --prompts
    golden/prompts-long-context.jsonl --golden-dir golden/long-context`), the chunked path's 5-token chunks included:
    on the GPU they cost seconds, and they are what a 4,000-token prefix under FlashInfer's paged prefill reaches."""
    gs = G.load_checked("smollm2-135m", "cuda", dtype, LONG_CONTEXT)
    assert len(gs.prompts) >= 2 and min(len(p.prompt_ids) for p in gs.prompts) >= 4000
    result = run.run_parity("smollm2-135m", device="cuda", dtype=dtype, golden_root=LONG_CONTEXT)
    print(write_report(result, write_files=False))
    assert result.passed, write_report(result, write_files=False)
    assert {p.path for p in result.paths} == {p.name for p in PATHS if p.applies_to("cuda", False)}
