// tandem_cpu::paged_attention (paged_attention.cpp), shared with the per-step layer op (attention_step.cpp).
#pragma once
#include <torch/types.h>

namespace tandem_cpu {

at::Tensor paged_attention(const at::Tensor& query, const c10::optional<at::Tensor>& key,
                           const c10::optional<at::Tensor>& value, at::Tensor k_cache, at::Tensor v_cache,
                           const c10::optional<at::Tensor>& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           const c10::optional<at::Tensor>& tree_mask, double scale, int64_t max_rows, at::Tensor out);

}  // namespace tandem_cpu
