"""Asynchronous training through gRPC parameter servers (Li et al. 2014; Dean et al. 2012).

S shard daemons each own a contiguous range of the model's flat parameter
vector and run the optimizer on it; W workers pull all shards, compute a
gradient with the same Replica as every other trainer, and push it back.
Consistency is a switch (ASP, SSP(s) after Ho et al. 2013, BSP), and the
staleness of every applied gradient is recorded (Zhang et al. 2016).

    dtlab-pserver serve --config run.json --shard 0 --num-shards 2 --port 50051
    dtlab-worker --config run.json --servers 127.0.0.1:50051,127.0.0.1:50052

    wire.py         tensors <-> header/chunk/trailer streams (hand codec, Adler-32)
    store.py        one shard: parameters, optimizer, version, dedup, staleness, ids, one lock
    consistency.py  worker clocks, ASP/SSP/BSP read rules, the BSP round
    staleness.py    exact staleness histograms, per shard and per worker
    blocked.py      the optimizer run on cache-sized blocks (bit-identical)
    servicer.py     the gRPC methods and the Session stream: decode, validate, hand to the store
    session.py      the worker's end of a Session stream (one per shard)
    shm.py          shared-memory segments for workers on the server's host
    runconfig.py    what workers and servers must agree on, checked at Register
    auth.py         bearer-token interceptor, TLS and mutual-TLS credentials
    metrics.py      Prometheus metrics (prometheus-client) on GET /metrics
    checkpoint.py   shard checkpoints on models/run/checkpoint.py
    inflight.py     the calls a shutdown lets finish, counted from their acceptance
    daemon.py       one shard's server: store + gRPC + health + reflection + metrics
    __main__.py     `dtlab-pserver serve`: flags, signals
    client.py       every shard in parallel: sessions, shm, health wait, deadlines, retries
    worker.py       `dtlab-worker`: the async SGD loop
    config.py       ServerConfig and ClientConfig (every field a flag)
    errors.py       errors named by the gRPC status they travel as
"""
