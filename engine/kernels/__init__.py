"""The engine's own GPU kernels, each beside its launcher and checked against a reference its docstring names. Nothing
is imported here: a launcher imports Triton, or builds its library, where it is used.

    page_ids.py          page_ids(): the paged-attention page lists' page ids, gathered from the page table (Triton);
                         against their definition (tests/test_page_ids.py)
    prefill_schedule.py  sm90_schedule(): FA3's prefill work list for a prefill graph (Triton); against FlashInfer's
                         own plan, PrefillSM90Plan (tests/test_prefill_schedule.py)
    graph_inputs.py      gather_decode_inputs(): a decode graph's ids, positions and KV slots into its static inputs
                         (Triton); against the torch gathers of GraphRunner.gather_decode_inputs (engine/graph.py) and
                         their definition (tests/test_graph_inputs.py)
    sample_kernel.py     draw(), argmax(): the sampler's draw and all-greedy argmax (Triton); against
                         engine/sample.py's float64 inverse CDF and torch's argmax (tests/test_sample_kernel.py)
    qk_rope_store.py     qk_rope_store(): q/k norms, RoPE and the KV store in one (Triton); against
                         TorchOps.qk_rope_store_ (engine/layers/ops.py) and float64 (tests/test_qk_rope_store.py,
                         harness/components/ops.py)
    skinny_gemm.py       skinny_gemm(): y = x W^T (+ b) for <= 16 rows, its kernel in skinny_gemm_kernel.py (Triton),
                         its configurations in skinny_gemm_tuned.json; against a float64 product and cuBLAS
                         (tests/test_skinny_gemm.py)
    narrow_gemm.py       narrow_gemm(): o_proj and down for <= 128 rows on sm90, its kernel in narrow_gemm.cu
                         (CUTLASS); against a float64 product within twice cuBLAS's error (tests/test_narrow_gemm.py)
"""
