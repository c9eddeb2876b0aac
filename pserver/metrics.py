"""Prometheus text exposition of a shard's stats, served on GET /metrics.

    python -m pserver serve ... --metrics-port 9100
    curl -s 127.0.0.1:9100/metrics | grep staleness

Written by hand in the text format (version 0.0.4) rather than with
prometheus-client: a dozen series from one StatsReply need no dependency.
Staleness histograms use cumulative buckets le = 0, 1, 2, 4, ..., 256, +Inf.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from protos import dtlab_ps_pb2 as pb
from pserver.staleness import PROMETHEUS_BOUNDS

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = (
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
)


def _labels(**kw) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in kw.items()) + "}"


def _histogram(lines: list[str], name: str, h: pb.Histogram, **labels) -> None:
    for le in PROMETHEUS_BOUNDS:
        count = sum(c for s, c in h.counts.items() if s <= le)
        lines.append(f"{name}_bucket{_labels(**labels, le=le)} {count}")
    lines.append(f"{name}_bucket{_labels(**labels, le='+Inf')} {h.total}")
    lines.append(f"{name}_sum{_labels(**labels)} {h.sum}")
    lines.append(f"{name}_count{_labels(**labels)} {h.total}")


def _family(name: str, kind: str, help_text: str) -> list[str]:
    """The HELP and TYPE lines that open a metric family."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def render(s: pb.StatsReply) -> str:
    shard = s.shard
    lines = []
    for name, help_text in _COUNTERS:
        full = f"dtlab_ps_{name}_total"
        lines += [*_family(full, "counter", help_text),
                  f"{full}{_labels(shard=shard)} {getattr(s, name)}"]
    lines += _family("dtlab_ps_rejected_total", "counter", "calls rejected, by reason")
    lines += [f"dtlab_ps_rejected_total{_labels(shard=shard, reason=r)} {n}"
              for r, n in sorted(s.rejected.items())]
    for name, value, help_text in (
            ("version", s.version, "shard version (updates applied)"),
            ("lr", s.lr, "learning rate of the last update"),
            ("max_clock_lead", s.max_clock_lead, "largest clock lead a pull was served at"),
            ("pushes_in_flight", s.pushes_in_flight, "push streams being received")):
        lines += [*_family(f"dtlab_ps_{name}", "gauge", help_text),
                  f"dtlab_ps_{name}{_labels(shard=shard)} {value}"]
    lines += _family("dtlab_ps_worker_clock", "gauge", "gradients accepted from each worker")
    lines += [f"dtlab_ps_worker_clock{_labels(shard=shard, worker=w)} {ws.clock}"
              for w, ws in sorted(s.workers.items())]
    lines += _family("dtlab_ps_staleness", "histogram",
                     "updates between a gradient's read and its apply")
    _histogram(lines, "dtlab_ps_staleness", s.staleness, shard=shard)
    lines += _family("dtlab_ps_worker_staleness", "histogram",
                     "staleness of each worker's applied gradients")
    for w, ws in sorted(s.workers.items()):
        _histogram(lines, "dtlab_ps_worker_staleness", ws.staleness, shard=shard, worker=w)
    return "\n".join(lines) + "\n"


class MetricsServer:
    """A plain HTTP server answering GET /metrics from `stats()`, on a daemon thread."""

    def __init__(self, host: str, port: int, stats: Callable[[], pb.StatsReply]):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = render(stats()).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
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
