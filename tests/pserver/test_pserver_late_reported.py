"""BSP with backup workers (Chen et al. 2016): each worker's late gradients, as the store
counts them (pserver.server.consistency), in the Stats reply over the wire and in the
Prometheus metrics of a real daemon."""

from __future__ import annotations

import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from support.pserver_util import addresses, connect, initial_params, serve


def scrape(port: int) -> dict:
    """GET /metrics: {(sample name, frozenset of labels): value}."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(body) for s in f.samples}


def test_late_gradients_per_worker_in_stats_and_metrics():
    """Three clients in a fixed order: workers 0 and 1 close each round, worker 2's pushes
    arrive after it closed (read at the version before) and are dropped as late."""
    params = initial_params()
    steps = 2
    with serve(shards=1, consistency="bsp", num_workers=3, backup_workers=1,
               metrics_port=0) as daemons:
        clients = [connect(addresses(daemons), w, params) for w in range(3)]
        try:
            flat = np.empty(params.size, np.float32)
            for c in clients:
                c.pull(flat)
            for step in range(steps):
                replies = [c.push(np.full(params.size, w + 1.0, np.float32), step)[0]
                           for w, c in enumerate(clients)]
                assert [r.staleness for r in replies] == [0, 0, 1]  # worker 2's: late
                for c in clients:
                    c.pull(flat)
            wire = clients[0].stats()[0]
            samples = scrape(daemons[0].metrics.port)
            counted = daemons[0].store.stats()
        finally:
            for c in clients:
                c.close()
    assert wire.late == counted.late == steps
    assert {w: ws.late for w, ws in wire.workers.items()} == {0: 0, 1: 0, 2: steps}
    assert {w: ws.late for w, ws in counted.workers.items()} == {0: 0, 1: 0, 2: steps}
    for w, late in ((0, 0), (1, 0), (2, steps)):
        labels = frozenset({"shard": "0", "worker": str(w)}.items())
        assert samples["dtlab_ps_worker_late_total", labels] == late
    assert samples["dtlab_ps_late_total", frozenset({"shard": "0"}.items())] == steps
