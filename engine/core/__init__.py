"""Host bookkeeping of one engine, no tensors: a request's state and progress (`request`: computed vs
total tokens), the scheduler that decides each step's work (`scheduler`), and the paged KV cache's block
ids (`block_manager`). Plain Python that tests drive without a model.

Never imports torch, kernels, structured/, or the engine's device side (runner/, models/, layers/,
masking/, sample/, speculative/, distributed/).
"""
