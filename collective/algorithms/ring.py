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
chunk j of step t + 1 (the same memory as chunk j of step t, just completed)
is sent on as soon as chunk j of step t has arrived and been added, while
chunks j + 1.. of step t are still arriving. Receives are posted a window of
C + 1 messages ahead (receive before send), into as many scratch slots of
the communicator's pool (reduce steps) or straight into the buffer
(all-gather steps; such a receive waits until our earlier send of the same
memory has completed). A chunk received and added at once is still in
cache. The requests are persistent (collective/transport/bindings.py), so a message
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
    (-1: none); send[m] is the (lo, hi) of buf it sends.
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
        self.recv, self.after_send, self.send = [], [], []
        for t in range(first, last):
            got, sent = order[received_segment(p, t, n)], order[sent_segment(p, t, n)]
            for j in range(c):
                m = (t - first) * c + j
                reduce = t < n - 1
                self.recv.append((cuts[got][j], cuts[got][j + 1], m % window if reduce else -1))
                self.after_send.append(-1 if reduce else m - (n - 1) * c)
                self.send.append((cuts[sent][j], cuts[sent][j + 1]))


class _Bound:
    """A plan bound to one buffer: persistent requests (MPI_Recv_init,
    MPI_Send_init), the array views the additions use, the ring neighbours and
    the waits for their messages.

    Each scratch slot is a page-aligned region with a page of slack, and the
    view a reduce step receives into starts at the page offset of the chunk
    of buf it is added to (collective/transport/pages.py).
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
        slots = link.ws.pages("ring", plan.window * stride, xp) if plan.n_reduce else None
        self.recv, self.send, self.adds = [], [], []
        for lo, hi, slot in plan.recv:
            if slot >= 0:
                into = mirror(slots, slot * stride, base + lo * item, (hi - lo) * item)
                into = into.view(buf.dtype)  # (chunk,)
                self.adds.append((buf[lo:hi], into))
            else:
                into = buf[lo:hi]
            self.recv.append(comm.Recv_init(byte_view(into), left, TAG_RING))
        for lo, hi in plan.send:
            self.send.append(comm.Send_init(byte_view(buf[lo:hi]), right, TAG_RING))

    def free(self) -> None:
        free_requests(self.recv + self.send)


def _bind(link: Link, buf, bounds: tuple[int, ...], first: int, last: int, chunk_bytes: int,
          xp, operation: str) -> _Bound:
    """The binding of this shape's plan to `buf`, from the link's caches."""
    key = ("ring", bounds, first, last, buf.dtype.char, chunk_bytes, operation)

    def make() -> _Bound:
        order, position = link.ring()
        plan = link.cache.plan(key, lambda: _Plan(order, position, list(bounds), first, last,
                                                  buf.itemsize, chunk_bytes))
        return _Bound(link, plan, buf, xp, operation)

    return link.cache.bound(key, buf, make)


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
) -> None:
    """Run steps [first, last) of the 2(N - 1)-step ring over `buf`, in place.

    buf: 1-D contiguous array, (L,). bounds: N + 1 segment offsets into it.
    Steps t < N - 1 reduce (add), steps t >= N - 1 gather (copy).
    divide: after the last reduce step divide the finished segment by this
        (averaging costs 1/N of a full pass).
    sync: called before a device buffer is handed to MPI (GPU stream sync).

    Message m is chunk m % C of step first + m // C; the loop runs them in
    order, and a message's work is its Wait, the add of a reduce step and the
    Start of the same chunk's next step: what the plan and the binding hold is
    only indexed here, Python's share of a step is kept to those calls.
    """
    bound = _bind(link, buf, bounds, first, last, chunk_bytes, xp, operation)
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
        if m < n_reduce:  # reduce-scatter: add what arrived into our own
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


def ring_allreduce(link: Link, buf, *, xp, sync, chunk_bytes: int, divide: int | None) -> None:
    """Sum (or average, divide=N) `buf` (L,) over the ring, in place."""
    n = link.size
    ring(link, buf, even_bounds(buf.size, n), 0, 2 * n - 2,
         xp=xp, sync=sync, chunk_bytes=chunk_bytes, divide=divide)


def ring_reduce_scatter(
    link: Link, buf, bounds: list[int], *, xp, sync, chunk_bytes: int, divide: int | None
) -> None:
    """Reduce `buf` (L,) so that rank r's segment buf[bounds[r]:bounds[r+1]]
    holds the sum; the other segments are left holding partial sums."""
    n = link.size
    ring(link, buf, tuple(bounds), 0, n - 1, xp=xp, sync=sync, chunk_bytes=chunk_bytes,
         divide=divide, operation="reduce_scatter(ring)")


def ring_allgather(link: Link, buf, bounds: list[int], *, xp, sync, chunk_bytes: int) -> None:
    """Fill every segment of `buf` from its owner: rank r owns buf[bounds[r]:bounds[r+1]]."""
    n = link.size
    ring(link, buf, tuple(bounds), n - 1, 2 * n - 2, xp=xp, sync=sync, chunk_bytes=chunk_bytes,
         operation="allgather(ring)")
