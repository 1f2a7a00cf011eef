"""The bench's GPU time by kind of kernel names every kernel the committed H200 reports profiled: the attention,
GEMM, norm, activation, fused q/k-norm and MoE routing kernels of decode and prefill graphs (FA3's paged prefill
kernel included) are each counted as what they do, and only the small gathers and schedules fall under "other"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.bench.profile import CATEGORIES, by_category

REPORTS = Path(__file__).resolve().parents[1] / "reports" / "bench"
# kernels that are none of the named kinds: the embedding's gather, the page-id gather, FA3's work-list builder
OTHER = ("indexSelect", "vectorized_gather", "page_ids", "sm90_schedule")


def _profiled_kernels() -> list[str]:
    names = set()
    for path in REPORTS.glob("cuda/*/bench.json"):
        report = json.loads(path.read_text())
        for section in ("profiles", "prefill_profiles"):
            for profile in report.get(section, []):
                names.update(k["kernel"] for k in profile.get("top_kernels", []))
    return sorted(names)


KERNELS = _profiled_kernels()


def test_the_reports_hold_prefill_and_decode_profiles():
    assert any("BatchDecode" in k for k in KERNELS) and any("PrefillWithKVCache" in k for k in KERNELS)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_profiled_kernel_has_its_kind(kernel):
    kind = next(iter(by_category([{"kernel": kernel, "us_per_step": 1.0}])))
    assert (kind == "other") == any(f in kernel for f in OTHER), f"{kernel!r} counted as {kind!r}"


def test_the_first_matching_kind_wins():
    assert [c for c, _ in CATEGORIES][0] == "q/k norm + rope + kv write"  # before "rope" and "kv write"
    assert by_category([{"kernel": "qk_rope_store_kernel", "us_per_step": 2.0},
                        {"kernel": "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "us_per_step": 3.0}]) == \
        {"q/k norm + rope + kv write": 2.0, "gemm": 3.0}
