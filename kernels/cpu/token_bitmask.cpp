// A grammar's token bitmask applied to CPU logits in place: torch.ops.tandem_cpu.token_bitmask, the semantics of
// kernels/bitmask.py (xgrammar's packed layout, row flags, bitmask row indices, a draft vocabulary's d2t offsets).
//
// Why: a guided speculative step masks its verification rows and every draft pass. The torch reference builds
// [rows, V] temporaries for each (a gather of words, shifts, a compare, a masked fill): ~0.5 ms a call with a draft
// vocabulary of 16k ids, ~2 ms of a 40 ms SmolLM2 MTP k=3 step on a 2-core CPU. Here one pass over the logits reads
// each word once per 32 tokens (without d2t) and writes only the banned ones.
#include <torch/library.h>
#include <torch/types.h>

#include <limits>

namespace {

template <typename scalar_t>
void mask_rows(scalar_t* logits, int64_t rows, int64_t V, int64_t stride, const int32_t* bitmask, int64_t bm_stride,
               int64_t bm_rows, const bool* flags, const int64_t* indices, const int64_t* d2t, int64_t vt) {
  const scalar_t banned = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    if (flags && !flags[r]) continue;  // no grammar: untouched
    const int64_t b = indices ? indices[r] : r;
    TORCH_CHECK(b >= 0 && b < bm_rows, "token_bitmask: row ", r, " reads bitmask row ", b, " of ", bm_rows);
    const int32_t* words = bitmask + b * bm_stride;
    scalar_t* out = logits + r * stride;
    if (!d2t) {
      const int64_t n = std::min(V, vt);
      for (int64_t w = 0; w * 32 < n; ++w) {
        const uint32_t word = uint32_t(words[w]);
        if (word == 0xffffffffu) continue;  // all allowed
        const int64_t hi = std::min<int64_t>(32, n - w * 32);
        for (int64_t j = 0; j < hi; ++j)
          if (!((word >> j) & 1u)) out[w * 32 + j] = banned;
      }
      continue;
    }
    for (int64_t c = 0; c < V; ++c) {
      const int64_t tid = c + d2t[c];
      if (tid < 0 || tid >= vt) continue;  // outside the bitmask's vocabulary: untouched, as in xgrammar
      if (!((uint32_t(words[tid >> 5]) >> (tid & 31)) & 1u)) out[c] = banned;
    }
  }
}

void token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const c10::optional<at::Tensor>& row_has_grammar,
                   const c10::optional<at::Tensor>& indices, const c10::optional<at::Tensor>& d2t, int64_t vocab_size) {
  TORCH_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu(), "tandem_cpu.token_bitmask runs on CPU tensors");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits [rows, V] with unit stride in V");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1, "bitmask int32 [R, W]");
  const int64_t rows = logits.size(0), V = logits.size(1);
  const int64_t vt = std::min<int64_t>(vocab_size, 32 * bitmask.size(1));
  at::Tensor flags, idx, offsets;
  if (row_has_grammar.has_value()) {
    TORCH_CHECK(row_has_grammar->scalar_type() == at::kBool && row_has_grammar->numel() == rows, "row_has_grammar bool [rows]");
    flags = row_has_grammar->contiguous();
  }
  if (indices.has_value()) {
    TORCH_CHECK(indices->numel() == rows && !indices->is_floating_point(), "indices int [rows]");
    idx = indices->to(at::kLong).contiguous();
  } else {
    TORCH_CHECK(bitmask.size(0) >= rows, "bitmask has ", bitmask.size(0), " rows for ", rows, " logits rows");
  }
  if (d2t.has_value()) {
    TORCH_CHECK(d2t->numel() == V && !d2t->is_floating_point(), "d2t int [V]");
    offsets = d2t->to(at::kLong).contiguous();
  }
  if (rows == 0 || V == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "tandem_cpu.token_bitmask", [&] {
    mask_rows<scalar_t>(logits.data_ptr<scalar_t>(), rows, V, logits.stride(0), bitmask.data_ptr<int32_t>(),
                        bitmask.stride(0), bitmask.size(0), flags.defined() ? flags.data_ptr<bool>() : nullptr,
                        idx.defined() ? idx.data_ptr<int64_t>() : nullptr,
                        offsets.defined() ? offsets.data_ptr<int64_t>() : nullptr, vt);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor? row_has_grammar, Tensor? indices, Tensor? d2t, "
        "int vocab_size) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("token_bitmask", &token_bitmask); }
