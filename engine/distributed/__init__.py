"""How the ranks of one decode group talk inside a forward: tensor-parallel groups and head slicing
(`parallel`), attention data parallelism's padded gather and scatter around the MLP and its per-step
row counts (`data_parallel`), and all-reduces and gathers through a shared mapping between CPU ranks of
one host (`shm_collectives`). torch.distributed only.

Never imports Ray (groups are handed in, built elsewhere), the scheduler, the runner, models, masking,
sampling or structured/: layers and the runner call in here, never the other way.
"""
