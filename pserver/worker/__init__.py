"""The worker role: clients of the shards (one per shard, with sessions, shared
memory, deadlines, retries and failover to a backup) and the loops that pull,
compute and push: one process, or a model-parallel group under MPI."""
