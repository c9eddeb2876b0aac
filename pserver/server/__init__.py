"""The server role: one shard of the flat parameter vector, its optimizer and
consistency policy, and the daemon that serves it over gRPC (with its checkpoints,
metrics and, with --replicas 2, the chain replication that keeps a backup)."""
