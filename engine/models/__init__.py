"""Model definitions and their checkpoints: the Llama family (Llama, Mistral, Qwen2, Qwen3) in one
module, DeepSeek-V3 (`deepseek_v3`, with multi-head latent attention in `mla`), the family -> model map
(`registry`), the draft heads that run inside the target's step (`draft_head`: the shared base; `mtp`,
`eagle3`), the CPU piecewise-compiled decoder layers, and loading (`loader`: HF safetensors into
tensor-parallel slices; `gguf`).

Never imports the runner, the scheduler, masking, sampling, the proposers (engine/speculative) or
structured/: a model is a function of its inputs; what drives it lives above.
"""
