"""Prometheus metrics of a shard, served on GET /metrics.

    python -m dtlab.pserver serve ... --metrics-port 9100
    curl -s 127.0.0.1:9100/metrics | grep staleness

The exposition is prometheus-client's: a collector turns one StatsReply into
the dtlab_ps_* families at every scrape (nothing is kept between scrapes),
and the client's process collector adds the daemon's memory, CPU time, open
file descriptors and start time (process_*). Each server has its own
registry, so several daemons in one process (the tests) report apart.
Staleness histograms (per shard, per worker, per Mixture-of-Experts expert)
use cumulative buckets le = 0, 1, 2, 4, ..., 256, +Inf folded from the exact
counts (pserver.server.staleness, pserver.server.expert_staleness).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from dtlab.protos import dtlab_ps_pb2 as pb

log = logging.getLogger(__name__)

BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
COUNTERS = (  # StatsReply field -> dtlab_ps_<field>_total
    ("updates", "optimizer steps taken"),
    ("pushes", "gradients accepted"),
    ("duplicates", "retried pushes answered without applying"),
    ("pulls", "pulls served"),
    ("pulls_not_modified", "pulls answered not-modified"),
    ("bytes_received", "gradient bytes accepted"),
    ("bytes_sent", "parameter bytes served"),
    ("apply_seconds", "seconds spent in the optimizer"),
    ("receive_seconds", "seconds receiving push streams, header to checked trailer"),
    ("check_seconds", "of those, seconds checking chunks (Adler-32, finite values)"),
    ("workers_dropped", "workers dropped when their lease ran out (--worker-timeout)"),
    ("late", "BSP with --backup-workers: gradients dropped as late, their round closed"),
)
GAUGES = (  # StatsReply field -> dtlab_ps_<field>
    ("version", "shard version (updates applied)"),
    ("lr", "learning rate of the last update"),
    ("max_clock_lead", "largest clock lead a pull was served at"),
    ("pushes_in_flight", "push streams being received"),
)


def buckets(h: pb.Histogram) -> list[tuple[str, int]]:
    """Cumulative (le, gradients with staleness <= le) from exact counts, ending at +Inf."""
    return [(str(le), sum(c for s, c in h.counts.items() if s <= le)) for le in BOUNDS] + [
        ("+Inf", h.total)]


def families(s: pb.StatsReply) -> Iterator[Metric]:
    """The dtlab_ps_* metric families of one StatsReply."""
    shard = str(s.shard)
    for name, help_text in COUNTERS:
        yield _one(CounterMetricFamily(f"dtlab_ps_{name}", help_text, labels=["shard"]),
                   [shard], getattr(s, name))
    rejected = CounterMetricFamily("dtlab_ps_rejected", "calls rejected, by reason",
                                   labels=["shard", "reason"])
    for reason, n in sorted(s.rejected.items()):
        rejected.add_metric([shard, reason], n)
    yield rejected
    for name, help_text in GAUGES:
        yield _one(GaugeMetricFamily(f"dtlab_ps_{name}", help_text, labels=["shard"]), [shard],
                   getattr(s, name))
    clock = GaugeMetricFamily("dtlab_ps_worker_clock", "gradients accepted from each worker",
                              labels=["shard", "worker"])
    for w, ws in sorted(s.workers.items()):
        clock.add_metric([shard, str(w)], ws.clock)
    yield clock
    expired = GaugeMetricFamily("dtlab_ps_worker_expired", "1 while a worker is dropped "
                                "because its lease ran out (--worker-timeout)",
                                labels=["shard", "worker"])
    for w, ws in sorted(s.workers.items()):
        expired.add_metric([shard, str(w)], int(ws.expired))
    yield expired
    late = CounterMetricFamily("dtlab_ps_worker_late", "BSP with --backup-workers: each "
                               "worker's gradients dropped as late (their round closed)",
                               labels=["shard", "worker"])
    for w, ws in sorted(s.workers.items()):
        late.add_metric([shard, str(w)], ws.late)
    yield late
    staleness = HistogramMetricFamily("dtlab_ps_staleness",
                                      "updates between a gradient's read and its apply",
                                      labels=["shard"])
    staleness.add_metric([shard], buckets(s.staleness), s.staleness.sum)
    yield staleness
    per_worker = HistogramMetricFamily("dtlab_ps_worker_staleness",
                                       "staleness of each worker's applied gradients",
                                       labels=["shard", "worker"])
    for w, ws in sorted(s.workers.items()):
        per_worker.add_metric([shard, str(w)], buckets(ws.staleness), ws.staleness.sum)
    yield per_worker
    per_expert = HistogramMetricFamily("dtlab_ps_expert_staleness",
                                       "updates to a MoE expert between a worker's pull and "
                                       "its push of the expert", labels=["shard", "expert"])
    for e, h in sorted(s.expert_staleness.items()):
        per_expert.add_metric([shard, e], buckets(h), h.sum)
    yield per_expert


def _one(family, labels: list[str], value):
    family.add_metric(labels, value)
    return family


class StatsCollector:
    """A prometheus-client collector reading the shard's stats at every scrape, and the
    daemon's count of calls in flight (pserver.server.inflight)."""

    def __init__(self, stats: Callable[[], pb.StatsReply], calls_in_flight: Callable[[], int]):
        self._stats, self._calls = stats, calls_in_flight

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield from families(s)
        yield _one(GaugeMetricFamily("dtlab_ps_calls_in_flight", "calls accepted and not "
                                     "finished (sessions not counted)", labels=["shard"]),
                   [str(s.shard)], self._calls())


def registry(stats: Callable[[], pb.StatsReply],
             calls_in_flight: Callable[[], int]) -> CollectorRegistry:
    """A registry of the shard's metrics and its process's (memory, CPU, descriptors)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(stats, calls_in_flight))
    ProcessCollector(registry=reg)
    return reg


class MetricsServer:
    """A plain HTTP server answering GET /metrics from `stats()`, on a daemon thread."""

    def __init__(self, host: str, port: int, stats: Callable[[], pb.StatsReply],
                 calls_in_flight: Callable[[], int]):
        reg = registry(stats, calls_in_flight)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(reg)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                log.debug("metrics: " + fmt, *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
