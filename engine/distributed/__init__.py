"""Tensor parallelism's process group and its collectives (parallel_state.py), and the symmetric-memory all-reduce
and logits exchange over NVLink (peer_memory.py). Below the layers, which shard over it."""
