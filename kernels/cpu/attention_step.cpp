// A step's attention metadata held in C++ for the duration of one forward, and the per-layer op that reads it:
// torch.ops.tandem_cpu.{attention_step_begin, attention_step_end, paged_attention_layer}.
//
// Why: a whole decode forward compiled as one inductor graph (engine/models/piecewise.py) calls
// paged_attention_layer(q, k, v, layer, scale) in the graph, with no Python between two layers. The graph's
// inputs then stay the model's inputs: the metadata (block tables whose width changes every step, the KV
// cache) is set around the graph's call instead, as vLLM's forward context does, so one graph serves every
// step of its row bucket. The cache writes are hidden from the graph: the op's only visible effect is its
// output, which every later layer depends on, so the compiler can neither drop nor reorder it.
#include <torch/library.h>
#include <torch/types.h>

#include <vector>

#include "paged_attention.h"

namespace {

struct Step {
  at::Tensor kv_cache;  // [layers, 2, N, S, Hkv, D]
  at::Tensor slot_mapping;  // [T] int64: T is the step's real rows; the graph's rows past it are padding
  at::Tensor block_tables, seq_lens, query_start_loc;
  c10::optional<at::Tensor> tree_mask;
};

// Per thread (engines on different threads each run their own forwards), a stack (a forward inside another's
// scope sees its own step, and the outer one's comes back).
thread_local std::vector<Step> steps;

void attention_step_begin(const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          const c10::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kv_cache [layers, 2, blocks, block_size, heads, head_dim], contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong, "slot_mapping int64 [T]");
  steps.push_back(Step{kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, tree_mask});
}

void attention_step_end() {
  TORCH_CHECK(!steps.empty(), "attention_step_end without attention_step_begin");
  steps.pop_back();
}

at::Tensor paged_attention_layer(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                                 double scale) {
  TORCH_CHECK(!steps.empty(), "tandem_cpu.paged_attention_layer runs only between attention_step_begin and "
              "attention_step_end");
  const Step& s = steps.back();
  TORCH_CHECK(layer >= 0 && layer < s.kv_cache.size(0), "layer ", layer, " is not one of the cache's ", s.kv_cache.size(0));
  const int64_t rows = s.slot_mapping.size(0), padded = query.size(0);
  TORCH_CHECK(padded >= rows && key.size(0) == padded && value.size(0) == padded, "query/key/value have ", padded,
              " rows, the step has ", rows);
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (padded > rows) out.narrow(0, rows, padded - rows).zero_();
  const at::Tensor kv = s.kv_cache.select(0, layer);
  tandem_cpu::paged_attention(query.narrow(0, 0, rows), key.narrow(0, 0, rows), value.narrow(0, 0, rows), kv.select(0, 0),
                              kv.select(0, 1), s.slot_mapping, s.block_tables, s.seq_lens, s.query_start_loc,
                              s.tree_mask, scale, -1, out.narrow(0, 0, rows));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("attention_step_begin(Tensor kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, Tensor? tree_mask) -> ()", &attention_step_begin);
  m.def("attention_step_end() -> ()", &attention_step_end);
  m.def("paged_attention_layer(Tensor query, Tensor key, Tensor value, int layer, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_attention_layer", &paged_attention_layer); }
