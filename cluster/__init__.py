"""Everything Ray- and network-shaped that is not a server.

- `runtime`: connect to a running Ray or start one in-process (the embedded default).
- `placement`: placement groups that keep a decode group's rank actors together.
- `rendezvous`: stores held by actors and reached through Ray (no listener), and the handshake that makes
  group creation fail fast.
- `groups`: standalone torch.distributed process groups (gloo on CPU, NCCL on CUDA) built from a store,
  without `init_process_group`, so actors can come and go without a global world.
- `channel`: the pairwise KV hand-over channel (msgpack header + tensor payload) on such a group.
- `ranks`: starting a tensor-parallel group of rank actors and wiring their process group.
"""
