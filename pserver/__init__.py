"""Asynchronous training through gRPC parameter servers (Li et al. 2014; Dean et al. 2012).

S shard daemons each own a contiguous range of the model's flat parameter
vector and run the optimizer on it; W workers pull all shards, compute a
gradient with the same Replica as every other trainer, and push it back.
Consistency is a switch (ASP, SSP(s) after Ho et al. 2013, BSP), and the
staleness of every applied gradient is recorded (Zhang et al. 2016).

    dtlab-pserver serve --config run.json --shard 0 --num-shards 2 --port 50051
    dtlab-worker --config run.json --servers 127.0.0.1:50051,127.0.0.1:50052

By role: `server/` holds a shard (store, consistency, optimizer, daemon,
replication), `worker/` the clients and training loops, `common/` what both
speak (codec, ranges, shared memory, configs, auth). ARCHITECTURE.md maps
every module.
"""

import dtlab.models  # noqa: F401 - first: its BLAS thread setting must precede NumPy's import
