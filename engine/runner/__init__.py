"""One step on the device: the step's inputs built from the scheduler's decisions (`batch`), the step
itself as one capturable function, target forward, masks, verification and draft chain, with every
tensor's shape named (`step`), CUDA graphs captured per batch size and replayed (`graphs`), the model
runner that owns the model, the KV cache and the buffers and runs a step (`model_runner`), and async
scheduling, step N+1 planned and launched before step N's outputs are read (`overlap`).

Never imports Ray, cluster/, the engine loop (llm_engine, llm) or structured/ (grammar masks come in
through engine/masking); the scheduler's types are read, never driven, from here.
"""
