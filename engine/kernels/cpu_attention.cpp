// Paged attention on the CPU in fp32: every query of a batch over its request's keys, read in place from the pool's
// slots (no gathered K/V copy, no mask tensor), one pass over the keys with an online softmax (FlashAttention's).
//
// A work item is (request, KV head, block of queries): its rows are the block's queries times the query heads that
// share the KV head (GQA), so each key is read once for all of them. Items are taken from a shared counter,
// the costliest first; each item is computed by one thread in a fixed order, so the result does not depend on the
// thread count or on which thread took which item.
//
// A row's keys are visited in blocks of BK aligned to multiples of BK from position 0: a block that holds no key the
// row sees leaves its max, sum and accumulator untouched (bit for bit), so a query's result depends only on its own
// keys, not on the other queries of its item.
//
// An item of at most MAX_NATURAL_ROWS rows (a decode: one query times the query heads of a KV head) would leave most
// of the 16 lanes of the transposed layout idle (3 of 16 at SmolLM2's 3 query heads a KV head, where every key cost
// D vector FMAs for the scores and D for the values), so it keeps its rows in their natural layout and runs its
// vectors across D: a key costs D/16 FMAs a row for its score and as many for its value, sixteen keys' scores are
// reduced into one vector at once (sum16), and the softmax runs across those keys. Which layout an item takes
// follows from its request's own query count and the GQA group, never from the batch; the same block and
// untouched-row rules hold in both.
//
// Built on first use by engine/kernels/cpu_kernels.py and called through ctypes.

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int MAX_ROWS = 64;  // rows of an item: queries x query heads of one KV head (so at most 64 of those)
constexpr int MAX_NATURAL_ROWS = 8;  // items of at most this many rows take the natural layout (Kernel::row_block)

// lane i: the sum of c[i]'s 16 lanes (a transposition and sum in four rounds of pairs)
inline vec sum16(vec c[16]) {
  const auto pair = [](vec x, vec y, ivec lo, ivec hi) {
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
  };
  const ivec lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const ivec lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const ivec lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const ivec lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  for (int i = 0; i < 8; ++i) c[i] = pair(c[2 * i], c[2 * i + 1], lo1, lo1 + 8);
  for (int i = 0; i < 4; ++i) c[i] = pair(c[2 * i], c[2 * i + 1], lo2, lo2 + 4);
  for (int i = 0; i < 2; ++i) c[i] = pair(c[2 * i], c[2 * i + 1], lo3, lo3 + 2);
  return pair(c[0], c[1], lo4, lo4 + 1);
}

struct Args {
  const float* q;
  int64_t q_stride;  // floats between two tokens' q rows (a query head's D floats follow one another)
  const float* k;
  const float* v;
  int64_t kv_stride;  // floats between two slots of the pool
  const int32_t* table;  // the page table: row r, position p -> the slot of that token
  int64_t table_stride;
  const int64_t* reqs;  // [B, 4]: first query row, queries, page-table row, cached keys
  int hq, hkv, window;
  float scale;
  float* out;  // [tokens, hq * D]
};

struct Item {
  int req, head, t0, t1;
  int64_t cost;
};

// One item's state, rows transposed: a row's values are lane m % 16 of vector m / 16, so every step of the online
// softmax runs across rows in vectors and each row's numbers follow the same operations in the same order whatever
// the item's other rows are.
template <int D>
struct Kernel {
  static constexpr int BK = 64;  // keys a block

  alignas(64) float qt[D * MAX_ROWS];  // [D][rows]: the item's queries, scaled, transposed
  alignas(64) float acc[D * MAX_ROWS];  // [D][rows]: the output, unnormalized
  alignas(64) float s[BK * MAX_ROWS];  // [BK][rows]: scores, then probabilities
  alignas(64) float row_max[MAX_ROWS], row_sum[MAX_ROWS];
  alignas(64) int64_t qpos[MAX_ROWS];
  const float* krow[BK];
  const float* vrow[BK];

  // The item's rows transposed (qt, acc [D][width]) or, for at most MAX_NATURAL_ROWS of them, natural (qt,
  // acc [rows][D], s [rows][BK]).
  void run(const Args& a, const Item& it) {
    const int64_t* r = a.reqs + 4 * it.req;
    const int64_t q_start = r[0], cached = r[3];
    const int32_t* slots = a.table + r[2] * a.table_stride;
    const int g = a.hq / a.hkv, rows = (it.t1 - it.t0) * g, mv = (rows + 15) / 16;
    const bool natural = rows <= MAX_NATURAL_ROWS;
    const int width = natural ? rows : 16 * mv;  // rows, padded to whole vectors where transposed
    const auto at = [&](int m, int d) { return natural ? m * D + d : d * width + m; };
    std::fill(qt, qt + D * width, 0.0f);
    for (int m = 0; m < width; ++m) qpos[m] = cached + it.t0 + std::min(m, rows - 1) / g;
    for (int m = 0; m < rows; ++m) {  // row m: query t0 + m / g, query head head * g + m % g
      const float* src = a.q + (q_start + it.t0 + m / g) * a.q_stride + (int64_t)(it.head * g + m % g) * D;
      for (int d = 0; d < D; ++d) qt[at(m, d)] = src[d] * a.scale;
    }
    std::fill(acc, acc + D * width, 0.0f);
    std::fill(row_max, row_max + width, NEG_INF);
    std::fill(row_sum, row_sum + width, 0.0f);
    const int64_t first_q = cached + it.t0, last_q = cached + it.t1 - 1;
    int64_t lo = a.window > 0 ? std::max<int64_t>(0, first_q - a.window + 1) : 0;
    lo -= lo % BK;
    const int64_t head_off = (int64_t)it.head * D;
    for (int64_t kb = lo; kb <= last_q; kb += BK) {
      const int n = (int)std::min<int64_t>(BK, last_q + 1 - kb), nb = (n + 15) / 16 * 16;
      for (int j = 0; j < nb; ++j) {  // keys past the request's last are its first again, masked
        const int64_t slot = slots[kb + (j < n ? j : 0)];
        krow[j] = a.k + slot * a.kv_stride + head_off;
        vrow[j] = a.v + slot * a.kv_stride + head_off;
      }
      if (natural) {
        for (int m = 0; m < rows; ++m) row_block(m, a.window, kb, n, nb);
        continue;
      }
      switch (mv) {
        case 1: block<1>(a.window, kb, n, first_q, last_q); break;
        case 2: block<2>(a.window, kb, n, first_q, last_q); break;
        case 3: block<3>(a.window, kb, n, first_q, last_q); break;
        default: block<4>(a.window, kb, n, first_q, last_q); break;
      }
    }
    for (int m = 0; m < rows; ++m) {
      const int t = it.t0 + m / g, h = it.head * g + m % g;
      float* dst = a.out + (q_start + t) * (int64_t)a.hq * D + (int64_t)h * D;
      const float inv = 1.0f / row_sum[m];
      for (int d = 0; d < D; ++d) dst[d] = acc[at(m, d)] * inv;
    }
  }

  // Row m over the block's nb keys (n of them real): scores 16 keys a vector, the online softmax across them, then
  // acc[m] += p_j v_j with lanes across D. A block that holds no key the row sees leaves the row untouched.
  void row_block(int m, int window, int64_t kb, int n, int nb) {
    static constexpr int DV = D / 16;
    const float* qm = qt + m * D;
    float* sm = s + m * BK;
    const ivec iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int ahead = (int)(qpos[m] - kb), reach = window > 0 ? window : INT32_MAX;  // the row's position - kb
    vec mx = splat(NEG_INF);
    for (int j0 = 0; j0 < nb; j0 += 16) {
      vec c[16];
      for (int i = 0; i < 16; ++i) {
        const float* kj = krow[j0 + i];
        vec x = load(kj) * load(qm);
        for (int v = 1; v < DV; ++v) x += load(kj + 16 * v) * load(qm + 16 * v);
        c[i] = x;
      }
      const ivec j = iota + j0, back = ahead - j;  // back: how far the key lies behind the row
      const vec sc = (j < n) & (back >= 0) & (back < reach) ? sum16(c) : splat(NEG_INF);
      store(sm + j0, sc);
      mx = sc > mx ? sc : mx;
    }
    const float block_max = lane_max(mx);
    if (block_max == NEG_INF) return;
    const float old = row_max[m], new_max = std::max(old, block_max), corr = exp16(splat(old - new_max))[0];
    vec sum = {};
    for (int j0 = 0; j0 < nb; j0 += 16) {
      const vec p = exp16(load(sm + j0) - new_max);
      store(sm + j0, p);
      sum += p;
    }
    row_max[m] = new_max;
    row_sum[m] = row_sum[m] * corr + lane_sum(sum);
    float* am = acc + m * D;
    vec o[DV];
    for (int v = 0; v < DV; ++v) o[v] = load(am + 16 * v) * corr;
    for (int j = 0; j < n; ++j) {
      const float pj = sm[j];
      const float* vj = vrow[j];
      for (int v = 0; v < DV; ++v) o[v] += pj * load(vj + 16 * v);
    }
    for (int v = 0; v < DV; ++v) store(am + 16 * v, o[v]);
  }

  template <int MV>
  void block(int window, int64_t kb, int n, int64_t first_q, int64_t last_q) {
    constexpr int W = 16 * MV;
    const int nb = (n + 7) / 8 * 8;  // keys computed: the block's, up to a multiple of 8 (masked past n)
    scores<MV>(nb);
    if (kb + nb - 1 > first_q || (window > 0 && kb < last_q - window + 1) || n < nb) {
      const int64_t reach = window > 0 ? window : INT64_MAX;
      for (int j = 0; j < nb; ++j) {  // mask where the block crosses a row's causal or window edge
        const int64_t kpos = j < n ? kb + j : INT64_MAX;
        float* sj = s + j * W;
        for (int m = 0; m < W; ++m) sj[m] = kpos <= qpos[m] && qpos[m] - kpos < reach ? sj[m] : NEG_INF;
      }
    }
    // the online softmax, across rows: s becomes e^(s - new max); sums and accumulators are rescaled to it
    vec shift[MV], corr[MV];
    for (int v = 0; v < MV; ++v) {
      const vec old = load(row_max + 16 * v);
      vec mx = old;
      for (int j = 0; j < nb; ++j) {
        const vec x = load(s + j * W + 16 * v);
        mx = x > mx ? x : mx;
      }
      store(row_max + 16 * v, mx);
      shift[v] = mx == NEG_INF ? splat(0.0f) : mx;  // a row that has seen no key yet keeps its zeros
      corr[v] = exp16(old - shift[v]);
    }
    vec sum[MV] = {};
    for (int j = 0; j < nb; ++j)
      for (int v = 0; v < MV; ++v) {
        const vec p = exp16(load(s + j * W + 16 * v) - shift[v]);
        store(s + j * W + 16 * v, p);
        sum[v] += p;
      }
    for (int v = 0; v < MV; ++v) store(row_sum + 16 * v, load(row_sum + 16 * v) * corr[v] + sum[v]);
    for (int d = 0; d < D; ++d)
      for (int v = 0; v < MV; ++v) store(acc + d * W + 16 * v, load(acc + d * W + 16 * v) * corr[v]);
    values<MV>(nb);
  }

  // s[j][:] = sum over d of k_j[d] q[d][:], JG keys at a time (JG x MV accumulators). A lane sums its products in
  // order, so over D = 256 its rounding error grows with the chain: chains of at most DC, added into s, keep it
  // within twice SDPA's at every head size (a chain of 256 reached four times).
  template <int MV>
  void scores(int nb) {
    constexpr int W = 16 * MV, JG = MV == 1 ? 8 : MV == 2 ? 8 : 4, DC = std::min(D, 64);
    for (int j0 = 0; j0 < nb; j0 += JG)
      for (int d0 = 0; d0 < D; d0 += DC) {
        vec c[JG][MV] = {};
        for (int d = d0; d < std::min(D, d0 + DC); ++d) {
          vec qv[MV];
          for (int v = 0; v < MV; ++v) qv[v] = load(qt + d * W + 16 * v);
          for (int i = 0; i < JG; ++i) {
            const float kd = krow[j0 + i][d];
            for (int v = 0; v < MV; ++v) c[i][v] += kd * qv[v];
          }
        }
        for (int i = 0; i < JG; ++i)
          for (int v = 0; v < MV; ++v) {
            float* sj = s + (j0 + i) * W + 16 * v;
            store(sj, d0 == 0 ? c[i][v] : load(sj) + c[i][v]);
          }
      }
  }

  // acc[d][:] += sum over j of v_j[d] p[j][:], DG of the D at a time (DG x MV accumulators)
  template <int MV>
  void values(int nb) {
    constexpr int W = 16 * MV, DG = std::min(D, MV == 1 ? 16 : MV == 2 ? 8 : 4);
    for (int d0 = 0; d0 < D; d0 += DG) {
      vec c[DG][MV];
      for (int i = 0; i < DG; ++i)
        for (int v = 0; v < MV; ++v) c[i][v] = load(acc + (d0 + i) * W + 16 * v);
      for (int j = 0; j < nb; ++j) {
        vec pv[MV];
        for (int v = 0; v < MV; ++v) pv[v] = load(s + j * W + 16 * v);
        const float* vj = vrow[j] + d0;
        for (int i = 0; i < DG; ++i)
          for (int v = 0; v < MV; ++v) c[i][v] += vj[i] * pv[v];
      }
      for (int i = 0; i < DG; ++i)
        for (int v = 0; v < MV; ++v) store(acc + (d0 + i) * W + 16 * v, c[i][v]);
    }
  }
};

template <int D>
void run_all(const Args& a, const std::vector<Item>& items, int threads) {
  std::atomic<size_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    thread_local std::unique_ptr<Kernel<D>> kernel;  // up to 150 KiB: made once a thread, not once a call
    if (!kernel) kernel = std::make_unique<Kernel<D>>();
    for (size_t i = next++; i < items.size(); i = next++) kernel->run(a, items[i]);
  }
}

}  // namespace

// Returns 0, or 1 where the head size has no kernel or more than MAX_ROWS query heads share a KV head.
extern "C" int cpu_attention(const float* q, int64_t q_stride, const float* k, const float* v, int64_t kv_stride,
                             const int32_t* table, int64_t table_stride, const int64_t* reqs, int num_reqs, int hq,
                             int hkv, int head_dim, int window, float scale, float* out, int threads) {
  if (hq % hkv != 0 || hq / hkv > MAX_ROWS) return 1;
  const Args a{q, q_stride, k, v, kv_stride, table, table_stride, reqs, hq, hkv, window, scale, out};
  const int g = hq / hkv, block = std::max(1, MAX_ROWS / g);
  std::vector<Item> items;
  for (int r = 0; r < num_reqs; ++r) {
    const int64_t queries = reqs[4 * r + 1], cached = reqs[4 * r + 3];
    for (int t0 = 0; t0 < queries; t0 += block) {
      const int t1 = (int)std::min<int64_t>(queries, t0 + block);
      int64_t keys = cached + t1;
      if (window > 0) keys = std::min<int64_t>(keys, window + t1 - t0);
      for (int h = 0; h < hkv; ++h) items.push_back({r, h, t0, t1, keys * (t1 - t0)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  threads = std::max(1, std::min<int>(threads, (int)items.size()));
  switch (head_dim) {  // the head sizes of the models one meets (cpu_kernels.HEAD_DIMS)
    case 16: run_all<16>(a, items, threads); break;
    case 32: run_all<32>(a, items, threads); break;
    case 48: run_all<48>(a, items, threads); break;
    case 64: run_all<64>(a, items, threads); break;
    case 80: run_all<80>(a, items, threads); break;
    case 96: run_all<96>(a, items, threads); break;
    case 112: run_all<112>(a, items, threads); break;
    case 128: run_all<128>(a, items, threads); break;
    case 160: run_all<160>(a, items, threads); break;
    case 192: run_all<192>(a, items, threads); break;
    case 256: run_all<256>(a, items, threads); break;
    default: return 1;
  }
  return 0;
}
