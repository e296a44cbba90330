// A Llama-family decoder's whole few-row forward (1-16 rows: decode, verification chains) in one C++ call:
// torch.ops.tandem_cpu.decoder_stack.
//
// Why: under cpu_compile="full" a SmolLM2 step was one inductor graph whose Python wrapper issues ~270 calls per
// step (120 streamed matmuls, 30 attentions, ~120 fused elementwise kernels, each with its own OpenMP region, and
// ~270 buffer views): ~3 ms of a 15-17 ms batch-1 step beyond the matmuls' own time (engine/models/piecewise.py's
// reading). Here the same forward runs as one op: the matmuls through tandem_cpu::linear_rows on the same packed
// weights (kernels/cpu/linear_rows.cpp), the attention through tandem_cpu::paged_attention_layer (the step's
// metadata set around the call, kernels/cpu/attention_step.cpp), and the small elementwise work (RMSNorm, q/k norm,
// rotary embedding, SiLU-and-multiply, residual adds) in plain loops on this thread: at these row counts it is a few
// thousand floats, cheaper than waking a second thread.
//
// Semantics are the eager forward's (engine/models/llama.py, kernels/norm_rope.py's references), in fp32:
//   stream = embed(ids) (or the input rows given); h = norm_in(stream) (layer 0)
//   h, stream = norm_in(h_prev + stream), h_prev + stream             (later layers)
//   q, k, v = split(h W_qkv^T + b); q, k = qk_norm(q, k); rope(q, k); a = attention(q, k, v)
//   h, stream = norm_post(a W_o^T + b + stream), a W_o^T + b + stream; h = down(silu(gate(h)) * up(h))
// and at the end (final norm(h + stream), h + stream). Residual streams after every block but the last are returned
// too (EAGLE-3 heads read some of them), as the whole graph returned them.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

// Per layer, in this order (Tensor?[]): absent entries are None.
enum Slot { IN_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, SLOTS };

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tandem_cpu::linear_rows", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, bias, n);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tandem_cpu::paged_attention_layer", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double)>();
  return op.call(q, k, v, layer, scale);
}

// out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i] over n floats
inline void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// stream[t] += h[t]; h[t] = norm(stream[t]), or for the first layer only h[t] = norm(stream[t])
void add_norm(float* h, float* stream, const at::Tensor& w, double eps, int64_t T, int64_t H, bool add) {
  const float* wp = w.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* s = stream + t * H;
    float* y = h + t * H;
    if (add)
      for (int64_t i = 0; i < H; ++i) s[i] += y[i];
    rms_norm(s, wp, float(eps), H, y);
  }
}

// x [T, heads, D] in place: the rotary embedding's rotate-half form over the first R dims of each head, with
// cos2 = [cos, cos] and sin2 = [-sin, sin] per row ([T, R], kernels/norm_rope.py rope_rows)
void rope(float* x, int64_t T, int64_t heads, int64_t D, const float* cos2, const float* sin2, int64_t R) {
  const int64_t half = R / 2;
  std::vector<float> tmp(R);
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos2 + t * R;
    const float* s = sin2 + t * R;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * D;
      for (int64_t i = 0; i < R; ++i) tmp[i] = v[i] * c[i] + v[i < half ? i + half : i - half] * s[i];
      for (int64_t i = 0; i < R; ++i) v[i] = tmp[i];
    }
  }
}


// out[i] = silu(gate[i]) * up[i] over n floats (exp8: scalar expf was ~2% of a SmolLM2 batch-1 step, 46k a token)
inline void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = tandem_cpu::exp8(_mm256_sub_ps(zero, g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

std::vector<at::Tensor> decoder_stack(const at::Tensor& input_ids, const at::Tensor& embed, const at::Tensor& cos2,
                                      const at::Tensor& sin2, const std::vector<c10::optional<at::Tensor>>& weights,
                                      const at::Tensor& final_norm, at::IntArrayRef layer_ids, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
                                      double scale) {
  const int64_t L = int64_t(layer_ids.size());
  TORCH_CHECK(L > 0 && int64_t(weights.size()) == L * SLOTS, "decoder_stack: ", SLOTS, " weight slots per layer for ",
              L, " layers, got ", weights.size());
  // Token ids, or the first block's input itself (a draft head's: its own projection of an embedding and a hidden)
  const bool given = input_ids.is_floating_point();
  TORCH_CHECK(given ? input_ids.dim() == 2 && input_ids.scalar_type() == at::kFloat && input_ids.size(1) == embed.size(1)
                    : input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong,
              "decoder_stack: input_ids int64 [T], or the first block's input fp32 [T, H]");
  TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat, "embed fp32 [V, H]");  // any strides (matvec_layout)
  for (int64_t l = 0; l < L; ++l) {  // a missing or misshapen weight is an error here, not a crash below
    for (int s : {IN_NORM, POST_NORM})
      TORCH_CHECK(weights[l * SLOTS + s].has_value() && weights[l * SLOTS + s]->scalar_type() == at::kFloat &&
                      weights[l * SLOTS + s]->is_contiguous() && weights[l * SLOTS + s]->numel() == embed.size(1),
                  "decoder_stack: layer ", l, " slot ", s, " (a norm) must be an fp32 [H] tensor");
    for (int s : {QKV, O, GATE_UP, DOWN})
      TORCH_CHECK(weights[l * SLOTS + s].has_value() && weights[l * SLOTS + s]->dim() == 3,
                  "decoder_stack: layer ", l, " slot ", s, " (a matrix) must be packed by kernels/linear_rows.py");
    TORCH_CHECK(weights[l * SLOTS + Q_NORM].has_value() == weights[l * SLOTS + K_NORM].has_value(),
                "decoder_stack: layer ", l, " has a q norm without a k norm or the reverse");
    for (int s : {Q_NORM, K_NORM})
      TORCH_CHECK(!weights[l * SLOTS + s].has_value() ||
                      (weights[l * SLOTS + s]->scalar_type() == at::kFloat && weights[l * SLOTS + s]->is_contiguous() &&
                       weights[l * SLOTS + s]->numel() == head_dim),
                  "decoder_stack: layer ", l, " slot ", s, " (a q/k norm) must be an fp32 [head_dim] tensor");
  }
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous() && final_norm.numel() == embed.size(1),
              "decoder_stack: final_norm must be an fp32 [H] tensor");
  const int64_t T = input_ids.size(0), H = embed.size(1), V = embed.size(0);
  const int64_t Dq = num_heads * head_dim, Dkv = num_kv_heads * head_dim;
  const at::Tensor c2 = cos2.reshape({T, -1}).contiguous(), s2 = sin2.reshape({T, -1}).contiguous();
  TORCH_CHECK(c2.scalar_type() == at::kFloat && c2.size(1) <= head_dim && c2.sizes() == s2.sizes(), "cos2/sin2 fp32 [T, 1, R]");
  const int64_t R = c2.size(1);
  const auto f32 = embed.options();

  at::Tensor stream = given ? input_ids.contiguous().clone() : at::empty({T, H}, f32), h = at::empty({T, H}, f32);
  at::Tensor streams = at::empty({std::max<int64_t>(L - 1, 0), T, H}, f32);
  if (!given) {
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const float* e = embed.data_ptr<float>();
    const int64_t sv = embed.stride(0), sh = embed.stride(1);
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ids[t] >= 0 && ids[t] < V, "token id ", ids[t], " outside the vocabulary of ", V);
      float* row = stream.data_ptr<float>() + t * H;
      for (int64_t i = 0; i < H; ++i) row[i] = e[ids[t] * sv + i * sh];
    }
  }
  float* sp = stream.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const auto& w = [&](int s) -> const c10::optional<at::Tensor>& { return weights[l * SLOTS + s]; };
    add_norm(hp, sp, *w(IN_NORM), eps, T, H, l > 0);  // l > 0: h is block l-1's MLP output, added to the stream
    if (l > 0) std::copy(sp, sp + T * H, streams.data_ptr<float>() + (l - 1) * T * H);  // the stream after block l-1
    at::Tensor qkv = linear_rows(h, *w(QKV), w(QKV_BIAS), Dq + 2 * Dkv);  // [T, Dq + 2 Dkv], fresh
    at::Tensor q = qkv.narrow(1, 0, Dq).contiguous(), k = qkv.narrow(1, Dq, Dkv).contiguous();
    at::Tensor v = qkv.narrow(1, Dq + Dkv, Dkv).contiguous().view({T, num_kv_heads, head_dim});
    float* qp = q.data_ptr<float>();
    float* kp = k.data_ptr<float>();
    if (w(Q_NORM).has_value()) {
      const float* qw = w(Q_NORM)->data_ptr<float>();
      const float* kw = w(K_NORM)->data_ptr<float>();
      for (int64_t i = 0; i < T * num_heads; ++i) rms_norm(qp + i * head_dim, qw, float(eps), head_dim, qp + i * head_dim);
      for (int64_t i = 0; i < T * num_kv_heads; ++i) rms_norm(kp + i * head_dim, kw, float(eps), head_dim, kp + i * head_dim);
    }
    rope(qp, T, num_heads, head_dim, c2.data_ptr<float>(), s2.data_ptr<float>(), R);
    rope(kp, T, num_kv_heads, head_dim, c2.data_ptr<float>(), s2.data_ptr<float>(), R);
    at::Tensor a = attention(q.view({T, num_heads, head_dim}), k.view({T, num_kv_heads, head_dim}), v, layer_ids[l], scale);
    at::Tensor o = linear_rows(a.view({T, Dq}), *w(O), w(O_BIAS), H);
    std::copy(o.data_ptr<float>(), o.data_ptr<float>() + T * H, hp);
    add_norm(hp, sp, *w(POST_NORM), eps, T, H, true);
    at::Tensor gu = linear_rows(h, *w(GATE_UP), w(GATE_UP_BIAS), 2 * intermediate);  // [T, 2 I]
    at::Tensor act = at::empty({T, intermediate}, f32);
    const float* g = gu.data_ptr<float>();
    float* ap = act.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      silu_mul(g + t * 2 * intermediate, g + t * 2 * intermediate + intermediate, intermediate, ap + t * intermediate);
    at::Tensor down = linear_rows(act, *w(DOWN), w(DOWN_BIAS), H);
    std::copy(down.data_ptr<float>(), down.data_ptr<float>() + T * H, hp);
  }
  add_norm(hp, sp, final_norm, eps, T, H, true);  // h = norm(h + stream), stream = h + stream
  std::vector<at::Tensor> out{h, stream};
  for (int64_t l = 0; l + 1 < L; ++l) out.push_back(streams.select(0, l));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("decoder_stack(Tensor input_ids, Tensor embed, Tensor cos2, Tensor sin2, Tensor?[] weights, Tensor final_norm, "
        "int[] layer_ids, int num_heads, int num_kv_heads, int head_dim, int intermediate, float eps, float scale) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decoder_stack", &decoder_stack); }
