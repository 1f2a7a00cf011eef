#!/usr/bin/env bash
# The CUDA half of the project, on a machine with an NVIDIA GPU and flashinfer-python (see README, "On a GPU").
#   tools/gpu_suite.sh STAGE [MODEL...]
#   STAGE: tests | golden | spread | parity | sampling | bench | bench-moe | serve | fuzz | resolution | tp | all
# golden and parity cover bf16 and fp32 for the given models (default: the GPU golden models); spread measures HF's
# sdpa-vs-eager spread again on each committed bf16 golden (its provenance only); tp runs parity with 2 ranks over
# NCCL when 2 GPUs are visible; bench-moe measures the qwen3-30b-a3b shape (dummy weights, 61 GB) into
# reports/bench/cuda/qwen3-30b-a3b/; serve measures a 32k prompt arriving beside 32 running requests under the
# driver's budgets (long-prompt.md) and qwen3-0.6b serving a sweep of arrival rates (serve.md); fuzz runs the
# scheduling fuzzer on tiny-qwen3 for FUZZ_BUDGET seconds (default 240; FUZZ_ARGS adds options, e.g. "--plant
# graph-plan-keyed-on-rows"); resolution measures the smallest planted
# fault each check detects (RESOLUTION_ARGS, default: bf16 and fp32 parity of SmolLM2 and tiny-qwen3 and the
# component checks, about 6 minutes on an H200). Results land in golden/ and reports/ (--update-reports).
# Set ENGINE_ZOO_GGUF to convert a local SmolLM2 GGUF without a registry; SAMPLING_ARGS="--real-model smollm2-135m"
# leaves Gemma 3's real logits out of the sampling stage when gemma3-270m is not staged.
set -uo pipefail
stage=${1:-all}; shift || true
models=("${@:-smollm2-135m tiny-qwen3 tiny-qwen3-untied tiny-gemma3 tiny-qwen3-moe}")
read -r -a models <<< "${models[*]}"
margs=(); for m in "${models[@]}"; do margs+=(--model "$m"); done
rc=0
run() { echo "+ $*"; "$@" || rc=1; }
python3 -m harness models prepare "${models[@]}" qwen3-0.6b qwen3-30b-a3b >/dev/null || exit 1
case $stage in tests|all) run python3 -m pytest -m cuda -q -rA -s -p no:cacheprovider tests/ ;; esac
case $stage in golden|all) for dt in bfloat16 float32; do run python3 -m harness golden --device cuda --dtype "$dt" "${margs[@]}"; done ;; esac
case $stage in spread) run python3 -m harness golden --refresh-spread --device cuda --dtype bfloat16 "${margs[@]}" ;; esac
case $stage in parity|all) run python3 -m harness parity --device cuda --dtype bfloat16 --dtype float32 --no-sampling --update-reports "${margs[@]}" ;; esac
case $stage in sampling|all) run python3 -m harness sampling --device cuda --update-reports ${SAMPLING_ARGS:-} ;; esac
case $stage in bench|all) run python3 -m harness bench --device cuda --update-reports ;; esac
case $stage in bench-moe|all) run python3 -m harness bench --device cuda --model qwen3-30b-a3b --update-reports ;; esac
case $stage in serve|all)
  run python3 -m harness.bench.long_context --device cuda --stall 2.5 --stall 3 --update-reports
  run python3 -m harness bench --serve --device cuda --model qwen3-0.6b --update-reports ;;
esac
case $stage in fuzz|all) run python3 -m harness fuzz --device cuda --budget "${FUZZ_BUDGET:-240}" --update-reports ${FUZZ_ARGS:-} ;; esac
case $stage in resolution|all) run python3 -m harness resolution --device cuda --update-reports ${RESOLUTION_ARGS:---check parity-bf16 --check parity-fp32 --check components --model smollm2-135m --model tiny-qwen3} ;; esac
case $stage in tp|all)
  if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    run python3 -m harness parity --device cuda --tp 2 --dtype bfloat16 --dtype float32 --no-sampling --update-reports --model tiny-qwen3
  else echo "tp: fewer than 2 GPUs visible, skipped"; fi ;;
esac
exit $rc
