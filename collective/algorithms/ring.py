"""Ring all-reduce = ring reduce-scatter + ring all-gather, on point-to-point MPI.

The bandwidth-optimal all-reduce of Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations" (JPDC 2009), as
popularised for deep learning by Baidu (Gibiansky 2017) and Horovod
(Sergeev & Del Balso 2018). Each rank talks only to its ring neighbours
(left = rank - 1 receives from, right = rank + 1 sends to), every step moves
one segment of 1/N of the buffer, and all links are busy at once.

The ring, on a 4-rank example
-----------------------------

Rank r holds a buffer a_r of L elements, cut into N = 4 segments 0..3 (the
first L % N segments get one element more). At step t every rank sends
segment (r - t - 1) mod N to its right and receives segment (r - t - 2) mod N
from its left. The first N - 1 steps add what arrives (reduce-scatter), the
next N - 1 overwrite with it (all-gather):

    step   rank 0            rank 1            rank 2            rank 3
    ---- reduce-scatter: receive a segment, add it into our own ----------
    0      s2 = a3+a0        s3 = a0+a1        s0 = a1+a2        s1 = a2+a3
    1      s1 = a2+a3+a0     s2 = a3+a0+a1     s3 = a0+a1+a2     s0 = a1+a2+a3
    2      s0 = SUM          s1 = SUM          s2 = SUM          s3 = SUM
    ---- all-gather: rank r now owns the finished segment r; pass it on --
    3      s3 = SUM          s0 = SUM          s1 = SUM          s2 = SUM
    4      s2 = SUM          s3 = SUM          s0 = SUM          s1 = SUM
    5      s1 = SUM          s2 = SUM          s3 = SUM          s0 = SUM

(row 1, rank 1: it receives s2 = a3+a0 from rank 0, which rank 0 built at
step 0, and adds its own a1[2].) "Rank" above is really the position in the
ring, and segment s is the one the rank at position s finishes: the ring
runs in the order Link.ring() chooses, which puts ranks that share a node,
and ranks bound to the same CPU, next to each other (NCCL likewise orders
its rings by topology), so that on a cluster most hops stay inside a node.
After step 2 rank r holds the complete sum of segment r, which is exactly
a reduce-scatter; steps 3-5 are exactly an all-gather; `reduce_scatter` and
`allgather` below run one half each.

Traffic: each of the 2(N - 1) steps sends and receives one segment of L/N
elements, so each rank sends 2(N - 1)/N * L elements in total, whatever N:
the lower bound for all-reduce, approached as 2L for large N (a
reduce-to-root + broadcast moves (N - 1) L through the root). That factor is
why nccl-tests reports busbw = algbw * 2(N - 1)/N: it is the bandwidth each
link actually carried. The price is latency: 2(N - 1) messages in sequence,
which is why smaller buffers go to other algorithms (collective/algorithms/choose.py).

In code (ring() below): `sent_segment(p, t)` and `received_segment(p, t)`
are the two formulas above; the plan lists the messages row by row (chunk
j of step t is message m = (t - first) C + j), the loop runs `for m in
messages`, and whether m falls in a step t < N - 1 chooses between adding
and overwriting, row for row as in the table.

Pipelining. Each segment is cut into C sub-chunks of about `chunk_bytes`, and
chunk j of step t + 1 (the same chunk of the segment just completed) is
sent on as soon as chunk j of step t has arrived and been added, while
chunks j + 1.. of step t are still arriving. Receives are posted a window of
C + 1 messages ahead (receive before send), into scratch slots of the
communicator's pool (reduce steps; C + 2 slots when partial sums are kept
there, below) or straight into the buffer (all-gather steps; such a
receive waits until our earlier send of the same memory has completed). A
chunk received and added at once is still in cache.

Where the sums are written. Within a node the neighbour reads what we send
with a copy on its own core, and a store to memory another core has read
must first invalidate that core's copy of each line: an add into such
memory ran several times slower than the same add into memory only we
touched (a 64 KB add at 4 ranks: about 6 us against 2.5; figures from
`dtlab-bench ring_steps`). So the partial sums of the reduce steps before
the last, which are only passed on (the all-gather overwrites that segment
of buf later), are added into the scratch slot that received them (slot +=
buf, the same two operands, so the same bits) and sent on from there; only
the last reduce step adds into buf. At two ranks that step is the only one,
and ring_allreduce swaps the ranks' segments every call instead.

The requests are persistent (collective/transport/bindings.py), so a message
costs one Start and one Wait from Python.

How small a chunk pays off depends on who copies the bytes. Over a network
the NIC moves chunk j + 1 while the CPU adds chunk j, so 256 KB - 1 MB chunks
hide most of the additions. Within one host MPICH moves large messages by
CMA (process_vm_readv), a copy the receiving rank performs itself inside its
wait, so nothing is in flight while it adds and sub-chunks only add messages:
hence the 4 MiB default `chunk_bytes` (collective/comm.py; figures:
scripts/RESULTS.md); lower it on a cluster.

Sums use `xp.add(x, y, out=x)`, into the buffer without a temporary.

Where a step's time goes (the wait, the add, the Starts, the loop's own
Python): `mpiexec -n 4 dtlab-bench ring_steps`, which sets `Link.stamps`
(collective/transport/stamps.py) to time every call the loop below makes;
unset, ring() only reads the attribute once a call.

Measure: mpiexec -n 4 dtlab-bench allreduce
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mpi4py import MPI

from dtlab.collective.transport.bindings import free_requests
from dtlab.collective.transport.link import TAG_RING, Link, byte_view
from dtlab.collective.transport.pages import PAGE, address, mirror
from dtlab.collective.transport.stamps import ADD, POST, START, WAIT

start_request = MPI.Prequest.Start  # start_request(req): req.Start(), one name for stamps


def segment_bounds(length: int, parts: int) -> list[int]:
    """Offsets of `parts` near-equal segments of `length` elements.

    The first `length % parts` segments get one element more:
    segment_bounds(10, 4) == [0, 3, 6, 8, 10].
    """
    base, extra = divmod(length, parts)
    bounds = [0]
    for s in range(parts):
        bounds.append(bounds[-1] + base + (s < extra))
    return bounds


def sent_segment(p: int, t: int, n: int) -> int:
    """The segment the rank at ring position p sends to its right at step t."""
    return (p - t - 1) % n


def received_segment(p: int, t: int, n: int) -> int:
    """The segment it receives from its left at step t (its left's sent_segment)."""
    return (p - t - 2) % n


class _Plan:
    """Every message of one ring pass, precomputed once per shape.

    Message m is chunk j = m % C of step t = first + m // C. recv[m] is
    (lo, hi, slot): it receives buf[lo:hi], into scratch slot number `slot`
    (a reduce step, added afterwards) or straight into buf (slot -1);
    after_send[m] is the send that must finish before that receive is posted
    (-1: none); send[m] is the (lo, hi) of buf it sends, read from buf or,
    for messages [C, n_partial + C), from the slot of message m - C.

    Messages [0, n_partial), those of the reduce steps before the last one
    (t < N - 2), hold partial sums that are only passed on: their sum stays in
    the scratch slot (slot += buf[lo:hi]) and the next step sends it from
    there, so a slot is taken again only once that send is done (one slot more
    than the window keeps the send started before that receive is posted).
    buf itself is written by the last reduce step and the gather steps only,
    and a gather receive waits only for a send that read buf.
    """

    def __init__(self, order: list[int], p: int, bounds: list[int], first: int, last: int,
                 itemsize: int, chunk_bytes: int):
        n = len(order)
        seg_max = max(bounds[s + 1] - bounds[s] for s in range(n))
        c = max(1, min(seg_max, -(-seg_max * itemsize // chunk_bytes)))
        self.chunk_max = -(-seg_max // c)
        # chunk j of segment s is buf[cuts[s][j]:cuts[s][j + 1]]
        cuts = [[bounds[s] + o for o in segment_bounds(bounds[s + 1] - bounds[s], c)]
                for s in range(n)]
        self.total = total = (last - first) * c
        # At most (N - 1) C ahead: a gather receive must never be posted before
        # the reduce-phase send that reads the same memory (step t + 1 - N) was
        # started, nor before that send completed (see ring()).
        self.window = window = min(total, c + 1, (n - 1) * c)
        self.n_chunks = c
        self.n_reduce = max(0, n - 1 - first) * c  # messages [0, n_reduce) are added
        self.n_partial = max(0, n - 2 - first) * c  # [0, n_partial): sums kept in scratch
        self.n_slots = slots = window + 1 if self.n_partial else window
        self.recv, self.after_send, self.send = [], [], []
        for t in range(first, last):
            got, sent = order[received_segment(p, t, n)], order[sent_segment(p, t, n)]
            for j in range(c):
                m = (t - first) * c + j
                if t < n - 1:  # reduce: into a slot, once the send from its last sum is done
                    self.recv.append((cuts[got][j], cuts[got][j + 1], m % slots))
                    held = m - slots  # the slot's previous message
                    self.after_send.append(held + c if 0 <= held < self.n_partial else -1)
                else:  # gather: into buf, once our send of that memory is done
                    self.recv.append((cuts[got][j], cuts[got][j + 1], -1))
                    old = m - (n - 1) * c  # that send, unless it sent a partial sum
                    self.after_send.append(-1 if c <= old < self.n_partial + c else old)
                self.send.append((cuts[sent][j], cuts[sent][j + 1]))


class _Bound:
    """A plan bound to one buffer: persistent requests (MPI_Recv_init,
    MPI_Send_init), the array views the additions use, the ring neighbours and
    the waits for their messages.

    Each scratch slot is a page-aligned region with a page of slack, and the
    view a reduce step receives into starts at the page offset of the chunk
    of buf it is added to (collective/transport/pages.py). adds[m] is the
    (destination, other operand) of message m's add: (slot, buf chunk) for a
    partial sum, (buf chunk, slot) for the last reduce step.
    """

    def __init__(self, link: Link, plan: _Plan, buf, xp, operation: str):
        comm, self.plan = link.comm, plan
        self.left, self.right = left, right = link.left(), link.right()
        waiter = link.waiter  # the waits of this operation, made once, not once a call:
        self.wait = waiter.waits_for(operation, left)  # wait(req): a message from the left
        self.wait_sent = waiter.waits_for(operation, right)  # wait(req): our send, read
        self.wait_all_sent = waiter.waitall_for(operation, right)  # wait_all_sent(reqs)
        item, base = buf.itemsize, address(buf)
        stride = -(-plan.chunk_max * item // PAGE) * PAGE + PAGE  # bytes per slot
        slots = link.ws.pages("ring", plan.n_slots * stride, xp) if plan.n_reduce else None
        c, n_partial = plan.n_chunks, plan.n_partial
        self.recv, self.send, self.adds = [], [], []
        for m, (lo, hi, slot) in enumerate(plan.recv):
            if slot >= 0:
                into = mirror(slots, slot * stride, base + lo * item, (hi - lo) * item)
                into = into.view(buf.dtype)  # (chunk,)
                self.adds.append((into, buf[lo:hi]) if m < n_partial else (buf[lo:hi], into))
            else:
                into = buf[lo:hi]
            self.recv.append(comm.Recv_init(byte_view(into), left, TAG_RING))
        for m, (lo, hi) in enumerate(plan.send):
            source = self.adds[m - c][0] if c <= m < n_partial + c else buf[lo:hi]  # (chunk,)
            self.send.append(comm.Send_init(byte_view(source), right, TAG_RING))

    def free(self) -> None:
        free_requests(self.recv + self.send)


class _Turns:
    """The bindings of one buffer, one per turn (see ring_allreduce)."""

    def __init__(self, bindings: list[_Bound]):
        self.bindings = bindings

    def free(self) -> None:
        for bound in self.bindings:
            bound.free()


def _bind(link: Link, buf, bounds: tuple[int, ...], first: int, last: int, chunk_bytes: int,
          xp, operation: str, turns: int) -> list[_Bound]:
    """The bindings of this shape's plans to `buf`, one per turn, from the link's caches.
    Turn k runs the ring as if every rank stood k positions further on."""
    key = ("ring", bounds, first, last, buf.dtype.char, chunk_bytes, operation, turns)

    def make() -> _Turns:
        order, position = link.ring()
        n = len(order)

        def bound(k: int) -> _Bound:
            plan = link.cache.plan(key + (k,), lambda: _Plan(
                order, (position + k) % n, list(bounds), first, last, buf.itemsize, chunk_bytes))
            return _Bound(link, plan, buf, xp, operation)

        return _Turns([bound(k) for k in range(turns)])

    return link.cache.bound(key, buf, make).bindings


def _post(plan: _Plan, bound: _Bound, posted: int, upto: int, now: bool) -> int:
    """Start receives [posted, upto) in message order (MPI matches them in that
    order); the number started so far. A gather receive lands where an earlier
    send reads from: ahead of time it is started only once that send is done
    (else this stops there), `now` (just before it is waited for) after waiting
    for that send, which is done or about to be: the data we wait for includes
    our contribution, which the right neighbour read."""
    recvs, sends, after_send = bound.recv, bound.send, plan.after_send
    while posted < upto:
        old = after_send[posted]
        if old >= 0:
            if now:
                bound.wait_sent(sends[old])
            elif not sends[old].Test():
                return posted
        recvs[posted].Start()
        posted += 1
    return posted


def ring(
    link: Link,
    buf,
    bounds: tuple[int, ...],
    first: int,
    last: int,
    *,
    xp,
    sync: Callable[[], None] | None,
    chunk_bytes: int,
    divide: int | None = None,
    operation: str = "allreduce(ring)",
    turns: int = 1,
) -> None:
    """Run steps [first, last) of the 2(N - 1)-step ring over `buf`, in place.

    buf: 1-D contiguous array, (L,). bounds: N + 1 segment offsets into it.
    Steps t < N - 1 reduce (add), steps t >= N - 1 gather (copy).
    divide: after the last reduce step divide the finished segment by this
        (averaging costs 1/N of a full pass).
    sync: called before a device buffer is handed to MPI (GPU stream sync).
    turns: the calls cycle through this many segment assignments (ring_allreduce).

    Message m is chunk m % C of step first + m // C; the loop runs them in
    order, and a message's work is its Wait, the add of a reduce step and the
    Start of the same chunk's next step: what the plan and the binding hold is
    only indexed here, Python's share of a step is kept to those calls.
    """
    every_turn = _bind(link, buf, bounds, first, last, chunk_bytes, xp, operation, turns)
    bound = every_turn[link.cache.turn(operation, turns) if turns > 1 else 0]
    plan = bound.plan
    total, window, c, n_reduce = plan.total, plan.window, plan.n_chunks, plan.n_reduce
    recvs, sends, adds = bound.recv, bound.send, bound.adds
    wait, add, start, post = bound.wait, xp.add, start_request, _post
    if link.stamps is not None:  # dtlab-bench ring_steps: every call timed (transport/stamps.py)
        stamps = link.stamps
        wait, add, start, post = (stamps.wrap(wait, WAIT), stamps.wrap(add, ADD),
                                  stamps.wrap(start, START), stamps.wrap(post, POST))
    final = n_reduce - c if divide is not None else total  # the last reduce step's messages

    posted = post(plan, bound, 0, window, False)
    if sync is not None:
        sync()
    for m in range(min(c, total)):  # step `first`: every chunk of the segment we send
        start(sends[m])
    for m in range(total):  # chunk m % C of the walk-through table's row first + m // C
        if posted <= m:
            posted = post(plan, bound, posted, m + 1, True)
        wait(recvs[m])
        if m < n_reduce:  # reduce-scatter: add what arrived and our own (_Bound.adds)
            dst, got = adds[m]  # (chunk,), (chunk,)
            add(dst, got, out=dst)
            if m >= final:  # the segment is final
                xp.true_divide(dst, divide, out=dst)
            if sync is not None:
                sync()
        if posted < total:
            posted = post(plan, bound, posted, min(m + 1 + window, total), False)
        if m + c < total:  # chunk j of step t + 1 is this chunk: pass it on
            start(sends[m + c])
    bound.wait_all_sent(sends)


@functools.lru_cache(maxsize=64)
def even_bounds(length: int, parts: int) -> tuple[int, ...]:
    """segment_bounds(length, parts) as a tuple, computed once per shape."""
    return tuple(segment_bounds(length, parts))


def ring_allreduce(link: Link, buf, *, xp, sync, chunk_bytes: int, divide: int | None,
                   turns: int | None = None) -> None:
    """Sum (or average, divide=N) `buf` (L,) over the ring, in place; turns: None
    for the default below, 1 to keep every rank on its segment (ring_steps compares).

    At two ranks the ranks swap segments every call (two turns): each then adds
    into the segment it received last, which only its own copy has written
    since, never into the one its neighbour has just read. A store to memory
    another core has read must first invalidate that core's copy of the line,
    which made the add of a 128 KB segment about 4x slower than the add alone
    (`mpiexec -n 2 dtlab-bench ring_steps`: rows ring and ring1). MPICH's
    reduce-scatter + allgather, the same two messages, adds into the half its
    peer has just read. a + b == b + a exactly, so the sum keeps every bit; at
    N > 2 a turn would change the order of the sums and only one of the N - 1
    adds would gain, so the ring keeps one turn there.
    """
    n = link.size
    if turns is None:
        turns = 2 if n == 2 else 1
    ring(link, buf, even_bounds(buf.size, n), 0, 2 * n - 2, xp=xp, sync=sync,
         chunk_bytes=chunk_bytes, divide=divide, turns=turns)


def ring_reduce_scatter(
    link: Link, buf, bounds: list[int], *, xp, sync, chunk_bytes: int, divide: int | None
) -> None:
    """Reduce `buf` (L,) so that rank r's segment buf[bounds[r]:bounds[r+1]]
    holds the sum; the other segments are left holding inputs or partial sums."""
    n = link.size
    ring(link, buf, tuple(bounds), 0, n - 1, xp=xp, sync=sync, chunk_bytes=chunk_bytes,
         divide=divide, operation="reduce_scatter(ring)")


def ring_allgather(link: Link, buf, bounds: list[int], *, xp, sync, chunk_bytes: int) -> None:
    """Fill every segment of `buf` from its owner: rank r owns buf[bounds[r]:bounds[r+1]]."""
    n = link.size
    ring(link, buf, tuple(bounds), n - 1, 2 * n - 2, xp=xp, sync=sync, chunk_bytes=chunk_bytes,
         operation="allgather(ring)")
