// y = x W^T (+ b) for the few rows of a CPU decode step (1-16: decode rows, draft chains, verification chains), on a
// weight packed once by kernels/linear_rows.py: torch.ops.tandem_cpu.linear_rows.
//
// Why: at these row counts a step is bound by reading its weights once. Inductor's packed GEMM read SmolLM2's
// weights at ~16 GB/s in a batch-1 step on the 2-core EPYC where a plain sum streams 24 GB/s, and MKL's one-row
// F.linear runs single-threaded at ~11 GB/s. Row-major W with short rows (576 floats) starts a new hardware-prefetch
// stream every 2 KB; packed as [N / 32, K, 32] (32 output rows interleaved per k) each thread instead reads one long
// sequential stream, and each k broadcasts x[m, k] against 32 outputs held in 4 vector accumulators: no horizontal
// sums. Accumulation is fp32. The packed weight may be fp32 or bf16 whatever x's dtype: bf16 halves the bytes a step
// reads and is widened to fp32 in registers (AVX2 has no bf16 arithmetic).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;  // output rows per packed block; kernels/linear_rows.py's PACK

#if defined(__AVX2__) && defined(__FMA__)
inline void load32(const float* p, __m256 (&w)[4]) {
  for (int v = 0; v < 4; ++v) w[v] = _mm256_loadu_ps(p + 8 * v);
}
// bf16 is fp32's upper half: interleaving zeros below each of 16 bf16 values widens them, two unpacks per 16 (a
// widening convert and a shift per 8 cost twice the instructions, and widening, not memory, bounded bf16 at one row).
// The unpacks work within 128-bit lanes (lo: values 0-3 and 8-11, hi: 4-7 and 12-15), so pack_rows stores each 16
// rows of a bf16 block with its middle two quads swapped, and the vectors come out in row order.
inline void load32(const at::BFloat16* p, __m256 (&w)[4]) {
  const __m256i zero = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
    w[2 * h] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    w[2 * h + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
  }
}
#endif

// Where row j of a block is stored within its k: in order for fp32; bf16 swaps the middle quads of each 16 (load32).
inline int64_t stored(int64_t j, const float*) { return j; }
inline int64_t stored(int64_t j, const at::BFloat16*) {
  const int64_t q = (j % 16) / 4;
  return j - (j % 16) + (q == 1 ? 2 : q == 2 ? 1 : q) * 4 + j % 4;
}

// acc[i][0..32) = x[i] . w[:, 0..32) for MR rows of x (fp32, row stride K) against one block (w[k * 32 + j]).
template <int MR, typename wt>
inline void block_rows(const float* x, int64_t K, const wt* w, float (&acc)[2][BLOCK], const char* ahead) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) a[i][v] = _mm256_setzero_ps();
  constexpr int64_t LINE = 64, STEP = BLOCK * sizeof(wt);  // bytes of the block per k
  for (int64_t k = 0; k < K; ++k) {
    if (ahead && (k * STEP) % LINE < STEP) _mm_prefetch(ahead + k * STEP, _MM_HINT_T0);
    __m256 wv[4];
    load32(w + k * BLOCK, wv);
    for (int i = 0; i < MR; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x + i * K + k);
      for (int v = 0; v < 4; ++v) a[i][v] = _mm256_fmadd_ps(xb, wv[v], a[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc[i] + 8 * v, a[i][v]);
#else
  for (int i = 0; i < MR; ++i) {
    std::fill(acc[i], acc[i] + BLOCK, 0.f);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < BLOCK; ++j) acc[i][j] += x[i * K + k] * static_cast<float>(w[k * BLOCK + stored(j, w)]);
  }
#endif
}

constexpr int64_t PREFETCH_ROWS = 8;

template <typename wt, typename ot>
void run(const float* x, int64_t M, int64_t K, const wt* w, int64_t N, const float* bias, ot* y) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  // Up to PREFETCH_ROWS rows every pass prefetches the next block: while the later row pairs compute from L1/L2,
  // memory keeps streaming (1 / 2 / 4 rows of SmolLM2's layers: 0.94x / 0.91x / 0.89x the time without). Past that
  // the passes are bound by arithmetic and the prefetches only compete (16 / 32 rows: 1.14x / 1.20x the time).
  const bool prefetch = M <= PREFETCH_ROWS;
  // Whole blocks per thread (each 32 x K, ~72 KB in fp32 at K = 576): enough to be worth a second thread's wake-up.
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    float acc[2][BLOCK];
    for (int64_t b = begin; b < end; ++b) {
      const wt* wb = w + b * K * BLOCK;
      const int64_t n0 = b * BLOCK, nr = std::min<int64_t>(BLOCK, N - n0);
      const char* ahead = prefetch && b + 1 < end ? reinterpret_cast<const char*>(wb + K * BLOCK) : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 2) {  // later pairs of rows read the block from L1/L2
        const int mr = int(std::min<int64_t>(2, M - m0));
        if (mr == 2)
          block_rows<2>(x + m0 * K, K, wb, acc, ahead);
        else
          block_rows<1>(x + m0 * K, K, wb, acc, ahead);
        for (int i = 0; i < mr; ++i)
          for (int64_t j = 0; j < nr; ++j)
            y[(m0 + i) * N + n0 + j] = static_cast<ot>(acc[i][j] + (bias ? bias[n0 + j] : 0.f));
      }
    }
  });
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "tandem_cpu.linear_rows runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2, "x [M, K], got ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BLOCK && packed.size(1) == x.size(1) && packed.is_contiguous() &&
                  n > (packed.size(0) - 1) * BLOCK && n <= packed.size(0) * BLOCK,
              "packed weight [ceil(n / ", BLOCK, "), K, ", BLOCK, "] from kernels/linear_rows.py's pack_rows for x [M, ",
              x.size(1), "] and n = ", n, ", got ", packed.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16, "weight fp32 or bf16, got ",
              packed.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x fp32 or bf16, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // x is small: widened once, read against every block
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias [n]");
    bf = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, n}, x.options());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  if (M == 0 || n == 0) return y;
  auto with_weight = [&](auto* yp) {
    if (packed.scalar_type() == at::kFloat)
      run(xf.data_ptr<float>(), M, K, packed.data_ptr<float>(), n, bp, yp);
    else
      run(xf.data_ptr<float>(), M, K, packed.data_ptr<at::BFloat16>(), n, bp, yp);
  };
  if (x.scalar_type() == at::kFloat)
    with_weight(y.data_ptr<float>());
  else
    with_weight(y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) { m.def("linear_rows(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("linear_rows", &linear_rows); }
