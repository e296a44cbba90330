"""Triton kernels, each beside a plain-torch reference with the same signature.

Every module exposes `name` (dispatch: Triton on CUDA or under TRITON_INTERPRET=1, else the
reference), `name_ref` and `name_triton`:
  attention     store_kv, paged_attention (varlen, GQA, split-KV flash decoding)
  mla_attention store_latent, mla_attention (MLA's latent cache, absorbed form; varlen, split-KV)
  latent_rope_store  MLA's latent norm, q/k rotation and latent cache store in one launch
  bitmask       apply_token_bitmask (xgrammar layout, row flags, index map, d2t)
  verify        verify_greedy, verify_rejection (+ target_probs), counter RNG from rng.py
  kv_transfer   pack_kv, unpack_kv (head slices for tp re-sharding)
  norm_rope     rms_norm (+ residual), rms_norm_cat (a draft head's two input norms side by side), apply_rope,
                rope_store_kv (rotary fused into the KV store, with Qwen3's per-head q/k norm), build_rope_cache
                (Llama-3, linear, YaRN scaling)
  activation    silu_and_mul (the gated MLP's activation of a fused gate/up projection)
"""
