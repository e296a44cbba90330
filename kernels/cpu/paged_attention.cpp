// Paged attention for a CPU step's few-row queries (decode rows, draft chains, verification chains and
// trees), with the step's K/V stores fused in: torch.ops.tandem_cpu.paged_attention.
//
// Why C++: the torch reference (kernels/attention.py) spends ~250 us a layer on a one-row decode, warm, and
// ~470 us in a decode step (2-core EPYC, SmolLM2-135M, ~130 tokens of context), almost all of it in a dozen
// small ops: 14 ms of a 52 ms step (bench/results/cpu_attention_cpu.md). Here one call per layer stores the new rows, then every (query row,
// KV head) pair walks its request's pages once: the G query heads of a KV head share each K/V row read.
// Semantics are the reference's: causal within a request's new rows, a draft tree's mask over the last
// 64 positions (bit w admits position seq_len - 64 + w; position 0 is always admitted), rows past
// query_start_loc[B] zeroed. Scores accumulate in fp32 whatever the cache's dtype. max_rows >= 0 leaves the
// rows of longer requests (prefill chunks) untouched, for the caller's reference to fill.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "paged_attention.h"
#include "vec_math.h"

#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

struct Scratch {  // per thread, reused across its items
  std::vector<float> qf, scores, kbuf, vbuf, inv;
  std::vector<const float*> krow, vrow;
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }


template <typename scalar_t>
void store_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                const at::Tensor& slot_mapping) {
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = v_cache.data_ptr<scalar_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;  // padding row, or a draft write past the request's blocks
    TORCH_CHECK(s < num_slots, "slot ", s, " is past the cache's ", num_slots, " slots");
    std::copy(k + t * key.stride(0), k + t * key.stride(0) + row, kc + s * row);
    std::copy(v + t * value.stride(0), v + t * value.stride(0) + row, vc + s * row);
  }
}

// Eight dot products q . k[j], j < 8, of length D (a multiple of 8): on AVX2 eight accumulators and one
// horizontal-add tree for all eight (a tree per dot product cost more than its multiply-adds).
template <int D>
inline void dot8(const float* q, const float* const* k, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[j] + d), a[j]);
  }
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: sums of 4
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  for (int j = 0; j < 8; ++j) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; ++d) s += q[d] * k[j][d];
    out[j] = s;
  }
#endif
}

// max over n scores (-inf for none), 8 lanes at a time: the scalar loop kept its running max in memory, a store-to-load
// chain per score that was ~20% of a 4-row step's attention.
inline float row_max(const float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t p = 0;
#if defined(__AVX2__)
  __m256 m = _mm256_set1_ps(top);
  for (; p + 8 <= n; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + p));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float l : lanes) top = std::max(top, l);
#endif
  for (; p < n; ++p) top = std::max(top, s[p]);
  return top;
}

// s[p] = exp(s[p] - top) over n scores, exactly 0 where s[p] - top < -87 (a refused position's -inf among them, which
// the weighted sum skips: never 0 * an unwritten slot's NaN); returns their sum. 8 lanes at a time (exp8: within ~2 ulp
// of expf).
inline float softmax_numerators(float* s, int64_t n, float top) {
  int64_t p = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 t = _mm256_set1_ps(top), floor = _mm256_set1_ps(-87.f);
  __m256 acc = _mm256_setzero_ps();
  for (; p + 8 <= n; p += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + p), t);
    const __m256 e = _mm256_and_ps(tandem_cpu::exp8(x), _mm256_cmp_ps(x, floor, _CMP_GE_OQ));
    _mm256_storeu_ps(s + p, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; p < n; ++p) {
    const float x = s[p] - top;
    s[p] = x >= -87.f ? std::exp(x) : 0.f;
    sum += s[p];
  }
  return sum;
}

// a[j] = sum_p e[j][p] v[p] (unnormalized) for J (<= 4) score rows e[j] (one KV head's query vectors) over n positions, one
// 16-float slice of D at a time: each V row slice is read once for the J vectors (not once per vector) and the 2 x J
// accumulators stay in registers. A position whose weight is 0 for a vector (refused, or negligible) adds nothing to it,
// never 0 * the slot's value (an unwritten slot may hold NaN).
template <int D>
inline void weighted_sum(const float* const* e, int J, const float* const* vrow, int64_t stride, int64_t n,
                         float (*a)[D]) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (D % 16 == 0) {
    for (int d = 0; d < D; d += 16) {
      __m256 acc[4][2];
      for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
      for (int64_t p = 0; p < n; ++p) {
        const float* v = vrow[p * stride] + d;
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        for (int j = 0; j < 4; ++j) {
          if (j >= J) break;
          const float x = e[j][p];
          if (x == 0.f) continue;
          const __m256 xb = _mm256_set1_ps(x);
          acc[j][0] = _mm256_fmadd_ps(xb, v0, acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(xb, v1, acc[j][1]);
        }
      }
      for (int j = 0; j < J; ++j) {
        _mm256_storeu_ps(a[j] + d, acc[j][0]);
        _mm256_storeu_ps(a[j] + d + 8, acc[j][1]);
      }
    }
    return;
  }
#endif
  for (int j = 0; j < J; ++j) {
    std::fill(a[j], a[j] + D, 0.f);
    for (int64_t p = 0; p < n; ++p) {
      const float x = e[j][p];
      if (x == 0.f) continue;
      const float* v = vrow[p * stride];
#pragma omp simd
      for (int d = 0; d < D; ++d) a[j][d] += x * v[d];
    }
  }
}

// One request's KV heads h0..h1-1 for its new rows i0..i1-1 (of q_len, the first at row0 of the step): (i1 - i0) rows
// x H heads x G query heads (R vectors, r = ((i - i0) * H + hh) * G + g for row i and query head (h0 + hh) * G + g)
// against the request's n positions. Scores land in [R][n] rows: 8 positions at a time per vector, then each row's
// softmax over contiguous floats, then the weighted sums of V rows, 4 vectors of a KV head at a time.
template <typename scalar_t, int D>
void attend_request(const scalar_t* q, int64_t q_t, int64_t q_h, const scalar_t* kc, const scalar_t* vc,
                    const int32_t* table, int64_t S, int64_t Hkv, int64_t h0, int64_t h1, int64_t G, int64_t row0,
                    int64_t q_len, int64_t i0, int64_t i1, int64_t len, int64_t limit, const int64_t* bits,
                    float scale, scalar_t* o, int64_t o_t, int64_t o_h, Scratch& w) {
  const int64_t H = h1 - h0, HG = H * G, R = (i1 - i0) * HG;
  const int64_t first = len - q_len;  // position of the first new row
  const int64_t n = std::min<int64_t>(len, limit);  // positions any row may read
  const int64_t window = len - 64;  // a tree mask decides positions window..len-1
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  if (n <= 0) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t hg = 0; hg < HG; ++hg)
        std::fill(o + (row0 + i) * o_t + (h0 * G + hg) * o_h, o + (row0 + i) * o_t + (h0 * G + hg) * o_h + D, scalar_t(0));
    return;
  }
  w.qf.resize(R * D);
  w.scores.resize(R * n);
  w.krow.resize(n * H);
  w.vrow.resize(n * H);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t hg = 0; hg < HG; ++hg)
      for (int d = 0; d < D; ++d)
        w.qf[((i - i0) * HG + hg) * D + d] = to_f(q[(row0 + i) * q_t + (h0 * G + hg) * q_h + d]) * scale;
  // Each position's K and V rows of these heads as fp32 pointers: read in place, or converted once.
  if constexpr (!std::is_same_v<scalar_t, float>) {
    w.kbuf.resize(n * H * D);
    w.vbuf.resize(n * H * D);
  }
  for (int64_t p = 0; p < n; ++p) {
    const int64_t slot = int64_t(table[p / S]) * S + p % S;
    for (int64_t hh = 0; hh < H; ++hh) {
      const int64_t off = (slot * Hkv + h0 + hh) * D;
      if constexpr (std::is_same_v<scalar_t, float>) {
        w.krow[p * H + hh] = kc + off;
        w.vrow[p * H + hh] = vc + off;
        // Ask for every line now: a decode step finds its KV evicted by the layer's weights, and waiting
        // for one miss at a time (the loops below) cost 2-3x the arithmetic.
        for (int d = 0; d < D; d += 64 / int(sizeof(float))) {
          __builtin_prefetch(kc + off + d);
          __builtin_prefetch(vc + off + d);
        }
      } else {
        float* kb = w.kbuf.data() + (p * H + hh) * D;
        float* vb = w.vbuf.data() + (p * H + hh) * D;
        for (int d = 0; d < D; ++d) kb[d] = to_f(kc[off + d]), vb[d] = to_f(vc[off + d]);
        w.krow[p * H + hh] = kb;
        w.vrow[p * H + hh] = vb;
      }
    }
  }
  float block[8];
  for (int64_t hh = 0; hh < H; ++hh)
    for (int64_t p = 0; p < n; p += 8) {
      const int64_t m = std::min<int64_t>(8, n - p);
      const float* k[8];
      for (int64_t j = 0; j < 8; ++j) k[j] = w.krow[(p + (j < m ? j : 0)) * H + hh];
      for (int64_t i = 0; i < i1 - i0; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (i * H + hh) * G + g;
          if (m == 8) {
            dot8<D>(w.qf.data() + r * D, k, w.scores.data() + r * n + p);
          } else {  // the last positions: 8 dot products, m kept
            dot8<D>(w.qf.data() + r * D, k, block);
            for (int64_t j = 0; j < m; ++j) w.scores[r * n + p + j] = block[j];
          }
        }
    }
  // Row i reads positions 0..first+i; a tree mask refuses some of the last 64 (never position 0).
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t last = first + i;  // causal: nothing past the row's own position
    const int64_t from = bits ? std::min<int64_t>(std::max<int64_t>(1, window), last + 1) : last + 1;
    for (int64_t p = std::max<int64_t>(from, 1); p < n; ++p) {  // position 0 always (no row sees nothing)
      const bool refused = p > last || !((bits[row0 + i] >> (p - window)) & 1);  // here bits is set if p <= last
      if (!refused) continue;
      for (int64_t hg = 0; hg < HG; ++hg) w.scores[((i - i0) * HG + hg) * n + p] = NEG;
    }
  }
  std::vector<float>& inv = w.inv;
  inv.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    float* sr = w.scores.data() + r * n;
    const float sum = softmax_numerators(sr, n, row_max(sr, n));
    inv[r] = sum > 0.f ? 1.f / sum : 0.f;
  }
  // Per KV head its (i1 - i0) x G vectors, 4 at a time.
  const int64_t per_head = (i1 - i0) * G;
  for (int64_t hh = 0; hh < H; ++hh)
    for (int64_t c0 = 0; c0 < per_head; c0 += 4) {
      const int J = int(std::min<int64_t>(4, per_head - c0));
      int64_t rs[4];
      const float* e[4];
      for (int j = 0; j < J; ++j) {
        const int64_t c = c0 + j, i = c / G, g = c % G;
        rs[j] = (i * H + hh) * G + g;
        e[j] = w.scores.data() + rs[j] * n;
      }
      float a[4][D];
      weighted_sum<D>(e, J, w.vrow.data() + hh, H, n, a);
      for (int j = 0; j < J; ++j) {
        const int64_t r = rs[j], i = i0 + r / HG, hg = r % HG;
        scalar_t* og = o + (row0 + i) * o_t + (h0 * G + hg) * o_h;
        for (int d = 0; d < D; ++d) og[d] = static_cast<scalar_t>(a[j][d] * inv[r]);
      }
    }
}

template <typename scalar_t, int D>
void attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
            const c10::optional<at::Tensor>& tree_mask, double scale, int64_t max_rows, at::Tensor& out) {
  const int64_t T = query.size(0), Hq = query.size(1);
  const int64_t S = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t B = block_tables.size(0), M = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* seq = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* bits = tree_mask.has_value() ? tree_mask->data_ptr<int64_t>() : nullptr;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t q_t = query.stride(0), q_h = query.stride(1), o_t = out.stride(0), o_h = out.stride(1);
  const int64_t real = std::min<int64_t>(std::max<int32_t>(qsl[B], 0), T);
  auto zero = [&](int64_t t) {
    for (int64_t h = 0; h < Hq; ++h) std::fill(o + t * o_t + h * o_h, o + t * o_t + h * o_h + D, scalar_t(0));
  };
  // Rows owned by no request (padding past qsl[B], or gaps) are zero, as in the reference.
  std::vector<char> owned(T, 0);
  int64_t work = 0;  // ~multiply-adds, to decide whether waking a second thread pays
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = std::max<int32_t>(qsl[b], 0), hi = std::min<int64_t>(qsl[b + 1], real);
    for (int64_t t = lo; t < hi; ++t) owned[t] = 1;
    if (hi > lo && (max_rows < 0 || hi - lo <= max_rows)) work += (hi - lo) * int64_t(std::max(seq[b], 0)) * Hq * D * 2;
  }
  for (int64_t t = 0; t < T; ++t)
    if (!owned[t]) zero(t);
  // The pages each attended request reads must be the cache's (checked here, not inside the threads).
  const int64_t N = k_cache.size(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = std::max<int32_t>(qsl[b], 0), hi = std::min<int64_t>(qsl[b + 1], real);
    if (hi <= lo || (max_rows >= 0 && hi - lo > max_rows)) continue;
    const int64_t pages = (std::min<int64_t>(std::max(seq[b], 0), M * S) + S - 1) / S;
    for (int64_t i = 0; i < pages; ++i)
      TORCH_CHECK(tables[b * M + i] >= 0 && tables[b * M + i] < N, "block_tables[", b, ", ", i, "] = ",
                  tables[b * M + i], " is not a block of the cache's ", N);
  }
  // Work items: whole requests (each page read once, front to back) when they are enough to keep every
  // thread busy or the step is too small to wake a second thread (a batch-1 decode row: a wake-up costs more
  // than it saves); otherwise (request, KV head) pairs, and those split by new rows into `parts` where the pairs
  // alone would leave a thread idle part of the time (3 KV heads on 2 threads: one thread does 2 of 3; a 4-row
  // verification chain in 2 halves makes it 3 of 6 each).
  const int64_t threads = at::get_num_threads();
  const bool inline_ = work < (1 << 18);
  const int64_t split = inline_ || B >= 2 * threads ? 1 : Hkv;
  const int64_t parts = split == 1 || (B * split) % threads == 0 ? 1 : threads;
  const int64_t items = B * split * parts;
  const int64_t grain = inline_ ? items + 1 : 1;  // a grain past the range runs on this thread
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (split * parts), pair = item % (split * parts), part = pair % parts;
      const int64_t h0 = split == 1 ? 0 : pair / parts, h1 = split == 1 ? Hkv : h0 + 1;
      const int64_t lo = std::max<int32_t>(qsl[b], 0), hi = std::min<int64_t>(qsl[b + 1], real);
      if (hi <= lo || (max_rows >= 0 && hi - lo > max_rows)) continue;  // longer requests: the caller's
      const int64_t q_len = hi - lo, i0 = q_len * part / parts, i1 = q_len * (part + 1) / parts;
      if (i1 <= i0) continue;  // fewer rows than parts: another part has them
      attend_request<scalar_t, D>(q, q_t, q_h, kc, vc, tables + b * M, S, Hkv, h0, h1, G, lo, q_len, i0, i1, seq[b],
                                  M * S, bits, float(scale), o, o_t, o_h, scratch);
    }
  });
}

// The head dim as a constant: unrolled, vectorized dot products. Mirrored by CPU_KERNEL_HEAD_DIMS
// (kernels/attention.py), which keeps other head dims on the reference.
template <typename scalar_t>
void attend_any(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                const c10::optional<at::Tensor>& tree_mask, double scale, int64_t max_rows, at::Tensor& out) {
  switch (query.size(2)) {
#define TANDEM_HEAD_DIM(d) \
  case d: attend<scalar_t, d>(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask, scale, max_rows, out); break;
    TANDEM_HEAD_DIM(16) TANDEM_HEAD_DIM(32) TANDEM_HEAD_DIM(40) TANDEM_HEAD_DIM(48) TANDEM_HEAD_DIM(64)
    TANDEM_HEAD_DIM(80) TANDEM_HEAD_DIM(96) TANDEM_HEAD_DIM(128) TANDEM_HEAD_DIM(256)
#undef TANDEM_HEAD_DIM
    default: TORCH_CHECK(false, "tandem_cpu.paged_attention: head dim ", query.size(2),
                         " is not built (16, 32, 40, 48, 64, 80, 96, 128, 256)");
  }
}

}  // namespace

namespace tandem_cpu {

at::Tensor paged_attention(const at::Tensor& query, const c10::optional<at::Tensor>& key,
                           const c10::optional<at::Tensor>& value, at::Tensor k_cache, at::Tensor v_cache,
                           const c10::optional<at::Tensor>& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           const c10::optional<at::Tensor>& tree_mask, double scale, int64_t max_rows, at::Tensor out) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "tandem_cpu.paged_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "query [T, Hq, D], caches [N, S, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "per-layer caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.sizes() == query.sizes(), "query/out [T, Hq, D], unit stride in D");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type(), "one dtype for query, cache and out");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0, "head dims / GQA group");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables int32, contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0), "seq_lens int32 [B]");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
              query_start_loc.size(0) == block_tables.size(0) + 1, "query_start_loc int32 [B + 1]");
  if (tree_mask.has_value())
    TORCH_CHECK(tree_mask->scalar_type() == at::kLong && tree_mask->is_contiguous() && tree_mask->size(0) == query.size(0), "tree_mask int64 [T]");
  const bool store = key.has_value();
  if (store) {
    TORCH_CHECK(value.has_value() && slot_mapping.has_value(), "key, value and slot_mapping come together");
    TORCH_CHECK(key->scalar_type() == k_cache.scalar_type() && value->scalar_type() == k_cache.scalar_type(), "key/value in the cache's dtype");
    TORCH_CHECK(key->dim() == 3 && key->size(1) == k_cache.size(2) && key->size(2) == k_cache.size(3) && key->sizes() == value->sizes() &&
                key->stride(2) == 1 && key->stride(1) == key->size(2) && value->stride(2) == 1 && value->stride(1) == value->size(2),
                "key/value [T, Hkv, D], dense rows");
    TORCH_CHECK(slot_mapping->scalar_type() == at::kLong && slot_mapping->is_contiguous() && slot_mapping->size(0) == key->size(0), "slot_mapping int64 [T]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "tandem_cpu.paged_attention", [&] {
    if (store) store_rows<scalar_t>(*key, *value, k_cache, v_cache, *slot_mapping);
    attend_any<scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask, scale, max_rows, out);
  });
  return out;
}

}  // namespace tandem_cpu

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor? key, Tensor? value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor? slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor? tree_mask, "
        "float scale, int max_rows, Tensor(c!) out) -> Tensor(c!)");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_attention", &tandem_cpu::paged_attention); }
