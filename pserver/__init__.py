"""Asynchronous training through gRPC parameter servers (Li et al. 2014; Dean et al. 2012).

S shard daemons each own a contiguous range of the model's flat parameter
vector and run the optimizer on it; W workers pull all shards, compute a
gradient with the same Replica as every other trainer, and push it back.
Consistency is a switch (ASP, SSP(s) after Ho et al. 2013, BSP), and the
staleness of every applied gradient is recorded (Zhang et al. 2016).

    python -m dtlab.pserver serve --model mlp --shard 0 --num-shards 2 --port 50051 ...
    python -m dtlab.pserver.worker --servers 127.0.0.1:50051,127.0.0.1:50052 --model mlp ...

    wire.py         tensors <-> header/chunk/trailer streams (zero-copy codec, Adler-32)
    store.py        one shard: parameters, optimizer, version, dedup, staleness, one lock
    consistency.py  worker clocks, ASP/SSP/BSP read rules, the BSP round
    staleness.py    exact staleness histograms, per shard and per worker
    blocked.py      the optimizer run on cache-sized blocks (bit-identical)
    servicer.py     the gRPC methods: decode, validate, hand to the store
    auth.py         bearer-token interceptor, TLS and mutual-TLS credentials
    metrics.py      Prometheus text exposition on GET /metrics
    checkpoint.py   shard checkpoints on models.checkpoint
    daemon.py       one shard's server: store + gRPC + health + reflection + metrics
    __main__.py     `python -m dtlab.pserver serve`: flags, signals
    client.py       every shard in parallel: health wait, deadlines, retries
    worker.py       `python -m dtlab.pserver.worker`: the async SGD loop
    config.py       ServerConfig and ClientConfig (every field a flag)
    errors.py       errors named by the gRPC status they travel as
"""
