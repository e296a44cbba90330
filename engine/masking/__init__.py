"""Which tokens each row of a step may take: the `LogitsMasker` interface and its bitmask application
(`masker`), structured outputs in the step, a masker over grammar matchers (`grammar`), and the same masks
filled by host functions captured in a CUDA graph (`graph`, over `host_func`: cudaLaunchHostFunc through
ctypes, run inline on CPU).

Never imports the models, the runner, the scheduler, sampling or the proposers: the runner and the step
hold a masker and call it. Grammar backends come from structured/, never the other way round.
"""
