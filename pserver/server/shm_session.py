"""A session's shared-memory section: the segment and the operations through it.

A session whose worker is on this host may agree on a shared-memory segment
(pserver.common.shm): the worker asks (ShmRequest, with its boot id), the server offers
a new segment or says why not (ShmOffer), the worker proves it mapped it (ShmAttach,
its token). Then a push's gradient and a pull's values move through the segment, with
the same header, checks, Adler-32 and (worker, step) deduplication as on the wire; a
push may carry the worker's next pull (ShmPush.then_pull), both answered by one
ShmPulled.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import buffers, shm
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.errors import DataLoss, FailedPrecondition, InvalidArgument
from dtlab.pserver.server.push_checks import check_header, dtype_name, push_ranges
from dtlab.pserver.server.store import PushResult

if TYPE_CHECKING:
    from dtlab.pserver.server.servicer import ParameterServerServicer

log = logging.getLogger(__name__)


class Segment:
    """A session's shared-memory segment, and whether the worker proved it mapped it."""

    def __init__(self, mapping: shm.Segment):
        self.mapping, self.ready = mapping, False

    def offer(self) -> pb.ShmOffer:
        m = self.mapping
        return pb.ShmOffer(path=str(m.path), size=m.size, data_offset=shm.DATA_OFFSET)

    def values(self, like: np.ndarray) -> np.ndarray:
        return self.mapping.array(like.dtype.newbyteorder("<"), like.size)

    def close(self) -> None:
        self.mapping.close()


def boot_id() -> str:
    """This host's boot id, which a co-located worker's ShmRequest names; "" where the
    host has no shared-memory folder."""
    return shm.boot_id() if shm.SHM_DIR.is_dir() else ""


def refusal(servicer: ParameterServerServicer, req: pb.ShmRequest) -> str:
    """Why `req` gets no segment (ShmOffer.refused)."""
    if not servicer.shm:
        return "the server runs with --no-shm"
    if not servicer.boot_id or req.boot_id != servicer.boot_id:
        return "the worker is on another host (boot ids differ)"
    return "the server could not create a segment"


def offer(servicer: ParameterServerServicer, req: pb.ShmRequest,
          current: Segment | None) -> Segment | None:
    """A new segment for a worker on this host, None where shared memory is out."""
    if current is not None:
        raise InvalidArgument("session: a second shm_request", reason="order")
    if not servicer.shm or not servicer.boot_id or req.boot_id != servicer.boot_id:
        return None
    try:
        return Segment(shm.Segment.create(servicer.store.params.nbytes))
    except OSError as e:
        log.warning("no shared-memory segment for a co-located worker: %s", e)
        return None


def attach(req: pb.ShmAttach, segment: Segment | None) -> pb.ShmReady:
    if segment is None or segment.ready:
        raise InvalidArgument("session: shm_attach without an offer", reason="order")
    segment.mapping.unlink()  # both ends hold it now, or the worker never will
    if not segment.mapping.holds(req.token):
        return pb.ShmReady(refused="wrong token: the worker mapped another segment")
    segment.ready = True
    return pb.ShmReady()


def push(servicer: ParameterServerServicer, m: pb.ShmPush, segment: Segment | None,
         then_pull: bool = False) -> PushResult:
    """A push from the session's segment; `then_pull`: a pull of the same segment follows,
    so the update it makes (of the whole shard) copies the new values into the segment
    as it goes (ShardStore.push's copy_to), which that pull then need not copy again."""
    if segment is None or not segment.ready:
        raise FailedPrecondition("session: shm_push before shm_attach", reason="order")
    store = servicer.store
    t0 = time.perf_counter()
    h = m.header
    check_header(h, servicer.meta, store.layout, shm=True)
    if h.HasField("compressed"):
        raise InvalidArgument("a compressed push travels over gRPC, not through shared "
                              "memory", reason="compressed")
    ranges = push_ranges(h, store.layout.length)
    servicer.step_times.report(h)
    result = store.admit(h.worker_id, h.step, h.meta.version)
    if result is not None:
        return result
    with store.receiving():
        grad = segment.values(store.params)  # a ranged push: packed from its start
        grad = grad if ranges is None else grad[: ranges_lib.size(ranges)]
        t1 = time.perf_counter()
        # backward: the worker wrote the segment forward, and the optimizer reads it
        # forward next: each finds in the cache what this pass read last
        checksum, bad = buffers.checksum_and_first_nonfinite_backward(grad,
                                                                      wire.ADLER_START)
        t2 = time.perf_counter()
        if bad >= 0:
            raise InvalidArgument(f"gradient element {bad} is {grad[bad]}: non-finite "
                                  "values are rejected", reason="nonfinite")
        if checksum != m.adler32:
            raise DataLoss(f"shm_push.adler32 {m.adler32:#010x} != {checksum:#010x} "
                           "computed over the segment", reason="checksum")
        store.received(t2 - t0, t2 - t1)
        servicer.traced_receive(h, t0, t2)
        return store.push(h.worker_id, h.step, h.meta.version, grad, ranges,
                          copy_to=grad if then_pull and ranges is None else None)


def pull(servicer: ParameterServerServicer, req: pb.PullRequest, segment: Segment | None,
         context, pushed: PushResult | None = None) -> pb.ShmPulled:
    """A pull into the session's segment; `pushed`: the push right before it on this
    session, whose update may have left this very version there already."""
    if segment is None or not segment.ready:
        raise FailedPrecondition("session: shm_pull before shm_attach", reason="order")
    if req.dtype not in (0, servicer.meta.dtype):
        raise InvalidArgument(f"shm_pull.dtype {dtype_name(req.dtype)}: the segment holds "
                              f"{dtype_name(servicer.meta.dtype)}", reason="dtype")
    read = servicer.read_pull(req, context, req.wait_timeout_s or None)
    try:
        if read.tensor is None:
            return pb.ShmPulled(header=servicer.pull_header(read))
        if pushed is not None and pushed.copied is not None \
                and pushed.version == read.version:  # no change since it copied them
            return pb.ShmPulled(header=servicer.pull_header(read), adler32=pushed.copied)
        checksum = read.tensor.copy_into(segment.values(servicer.store.params))
        return pb.ShmPulled(header=servicer.pull_header(read), adler32=checksum)
    finally:
        servicer.store.release(read)
