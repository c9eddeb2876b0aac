"""A shard's statistics (ShardStore.stats: ShardStats) as the wire's StatsReply.

The store speaks arrays and numbers; this builds the protobuf reply the Stats
call (and the daemon's metrics, through the servicer's `stats`) returns.
"""

from __future__ import annotations

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.server.staleness import Histogram
from dtlab.pserver.server.store import ShardStats, ShardStore

# the read rules (--consistency) as the wire names them (StatsReply, DescribeReply,
# RegisterReply)
CONSISTENCY = {"asp": pb.ASP, "ssp": pb.SSP, "bsp": pb.BSP}


def histogram(h: Histogram) -> pb.Histogram:
    return pb.Histogram(counts=dict(h.counts), total=h.total, sum=h.sum, max=h.max)


def stats_reply(s: ShardStats, store: ShardStore) -> pb.StatsReply:
    lay = store.layout
    workers = {w: pb.WorkerStats(clock=ws.clock, next_step=ws.next_step, active=ws.active,
                                 staleness=histogram(ws.staleness), expired=ws.expired,
                                 late=ws.late)
               for w, ws in s.workers.items()}
    return pb.StatsReply(
        shard=lay.shard, num_shards=lay.num_shards, consistency=CONSISTENCY[store.policy.mode],
        version=s.version, updates=s.updates, pushes=s.pushes, duplicates=s.duplicates,
        rejected=dict(s.rejected), pulls=s.pulls, pulls_not_modified=s.pulls_not_modified,
        bytes_received=s.bytes_received, bytes_sent=s.bytes_sent,
        staleness=histogram(s.staleness), workers=workers, max_clock_lead=s.max_clock_lead,
        lr=s.lr, apply_seconds=s.apply_seconds, pushes_in_flight=s.pushes_in_flight,
        receive_seconds=s.receive_seconds, check_seconds=s.check_seconds,
        workers_dropped=s.workers_dropped, late=s.late,
        expert_staleness={e: histogram(h) for e, h in s.expert_staleness.items()})
