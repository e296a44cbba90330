"""The building blocks of the models: tensor-parallel linears, the token embedding and LM head
(`linear`), norms, rotary embedding, attention over the paged KV cache with its per-forward metadata
(`attention`), and CPU matmuls compiled by inductor (`packed_gemm`, `cpu_compile`) or streamed by a C++ kernel
(`streamed_gemm`).

Never imports the models, the runner, the scheduler, masking, sampling, speculation or structured/;
below it are only kernels/, engine/distributed and engine's leaf modules (config, errors, scoped).
"""
