// y [M, N] = x [M, K] W [N, K]^T in bf16 with fp32 accumulation, on sm90a (narrow_gemm.py has the reasons and the
// build): CUTLASS 3's TMA warp-specialized ping-pong kernel over 64 x 32 output tiles and 128-wide K steps, one tile a
// CTA at a time over a persistent grid, no split of K (a row's sums do not depend on M), launched under programmatic
// dependent launch where asked (its loads and stores wait on the grid before it; CUTLASS_ENABLE_GDC_FOR_SM90).
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using T = cutlass::bfloat16_t;
using OutTile = Shape<_64, _32, _128>;
using OneCta = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, OutTile, OneCta, cutlass::epilogue::collective::EpilogueTileAuto,
    float, float, void, cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor, 8,
    cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8,  // x: M x K, row-major
    T, cutlass::layout::ColumnMajor, 8,                                                      // W: K x N, column-major
    float, OutTile, OneCta,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                    cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

static Gemm::Arguments arguments(const void* x, const void* w, void* y, int m, int n, int k, int sms) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sms;
  return {cutlass::gemm::GemmUniversalMode::kGemm, {m, n, k, 1},
          {static_cast<const T*>(x), cutlass::make_cute_packed_stride(Kernel::StrideA{}, {m, k, 1}),
           static_cast<const T*>(w), cutlass::make_cute_packed_stride(Kernel::StrideB{}, {n, k, 1})},
          {{1.f, 0.f}, nullptr, cutlass::make_cute_packed_stride(Kernel::StrideC{}, {m, n, 1}),
           static_cast<T*>(y), cutlass::make_cute_packed_stride(Kernel::StrideD{}, {m, n, 1})},
          hw};
}

extern "C" size_t narrow_gemm_workspace(int m, int n, int k, int sms) {
  return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, m, n, k, sms));
}

// 0 on success; 1: the problem is not one the kernel implements; 2: initialisation failed; 3: the launch failed
extern "C" int narrow_gemm(const void* x, const void* w, void* y, int m, int n, int k, int sms, void* workspace,
                           void* stream, int pdl) {
  Gemm gemm;
  auto args = arguments(x, w, y, m, n, k, sms);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  auto s = static_cast<cudaStream_t>(stream);
  if (gemm.initialize(args, workspace, s) != cutlass::Status::kSuccess) return 2;
  return gemm.run(s, nullptr, pdl != 0) == cutlass::Status::kSuccess ? 0 : 3;
}
