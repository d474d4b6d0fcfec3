# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled verbs fast path: the per-operation verbs calls without pyverbs' objects.

Built by ``scripts/build_fastpath.py`` (run by ``scripts/setup.sh``) against the private
rdma-core prefix's pyverbs declarations; where it is not built, :mod:`aiordma._verbs.compiled` says so
and the pure-Python path (pyverbs' ``CQ.poll``, ``QP.post_send``) runs instead. Nothing here
decides anything: which work request to post, and what a completion means, stay with the
Python callers (the reactor, the queue pair, the message protocol).

- :class:`CQDriver`: one call per channel wake-up reads the event, acknowledges events in
  batches, polls into a preallocated ``ibv_wc`` array, routes each completion by ``wr_id`` to
  its handler as a :class:`Completion` (the fields of a pyverbs ``WC`` that aiordma reads),
  re-arms and polls again.
- :class:`QPDriver`: posts one send work request from plain integers (no ``SendWR``/``SGE``
  property setters), and receive slots from work requests built once;
  :func:`create_rc_qp` makes the queue pair it drives (pyverbs' ``QP``, one verbs call).
- :class:`SRQDriver`: a shared receive queue's slots, built once, posted as chains.
- :class:`StepRunner`: one rank's step program (a collective's schedule) carried in the
  completions' callback: WRITEs posted, peers' WRITEs taken, reducers called.
- :class:`QuickCore`: a group's quick collective calls from the caller's arguments to the
  step runner and back in one call (which calls are quick, and their plans, stay with
  ``services/collectives/_quick.py``).

One compiled module, in six files: this one (:class:`Completion`, :class:`CQDriver`) and
``_fastpath_qp.pxi``, ``_fastpath_srq.pxi``, ``_fastpath_route.pxi`` (:class:`MessageRoute`),
``_fastpath_steps.pxi`` (:class:`StepRunner`), ``_fastpath_quick.pxi`` (:class:`QuickCore`),
included at its end.

Lifetimes: pyverbs' ``close()`` sets its C pointers to NULL, so every call reads the pointer
through the pyverbs object it holds and refuses a NULL one (``EBADF``); nothing caches a
pointer past a call. Each driver cross-checks a field through both views once (the queue pair
number, the channel's fd), in case pyverbs' layout differs from the declarations it was
compiled with.
"""

from libc.errno cimport EAGAIN, EBADF, errno
from libc.stdlib cimport calloc, free
from libc.string cimport memset

from pyverbs.cq cimport CQ, CompChannel
from pyverbs.pd cimport PD
from pyverbs.qp cimport QP
from pyverbs.srq cimport SRQ
cimport pyverbs.libibverbs as v
cimport pyverbs.libibverbs_enums as e

from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.messages import Lifecycle

cdef enum:
    BATCH = 64  # completions per ibv_poll_cq call

cdef unsigned long long ROUTE_MIN = 0x1_0000_0000  # wr_ids from here on belong to routes


cdef class Completion:
    """One work completion (named like pyverbs' ``WC``'s fields)."""

    cdef readonly unsigned long long wr_id
    cdef readonly int status
    cdef readonly int opcode
    cdef readonly unsigned int vendor_err
    cdef readonly unsigned int byte_len
    cdef readonly unsigned int imm_data
    cdef readonly unsigned int qp_num
    cdef readonly int wc_flags

    def __repr__(self):
        return (f"Completion(wr_id={self.wr_id:#x}, status={self.status}, opcode={self.opcode}, "
                f"byte_len={self.byte_len})")


def completion(unsigned long long wr_id, int status=0, int opcode=0, unsigned int byte_len=0,
               unsigned int vendor_err=0, unsigned int imm_data=0, unsigned int qp_num=0,
               int wc_flags=0):
    """A :class:`Completion` from its fields (for tests; the driver builds its own)."""
    cdef Completion c = Completion.__new__(Completion)
    c.wr_id = wr_id
    c.status = status
    c.opcode = opcode
    c.byte_len = byte_len
    c.vendor_err = vendor_err
    c.imm_data = imm_data
    c.qp_num = qp_num
    c.wc_flags = wc_flags
    return c


cdef class CQDriver:
    """The verbs work of one completion queue and its channel, per wake-up.

    Args:
        cq, channel: pyverbs' ``CQ`` and the ``CompChannel`` it reports to.
        ack_batch: channel events acknowledged per ``ibv_ack_cq_events`` call.
        report: called with an exception a handler raised (the others still run).

    pyverbs does not count the events read here: call :meth:`ack_all` before ``CQ.close()``
    (``ibv_destroy_cq`` waits for every event to be acknowledged).
    """

    cdef CQ _cq
    cdef CompChannel _channel
    cdef v.ibv_wc _wc[BATCH]
    cdef readonly int unacked
    cdef int _ack_batch
    cdef readonly unsigned long long completions
    cdef readonly unsigned long long wakeups
    cdef object _report
    cdef public bint draining  # inside a drain: wake-ups that are calls wait in `later`
    cdef public list later  # calls run once the drain (the whole wake-up) is over

    compiled = True

    def __cinit__(self, CQ cq not None, CompChannel channel not None, int ack_batch, report):
        if cq.cq == NULL or channel.cc == NULL:
            raise ValueError("the CQ or its channel is closed")
        if channel.cc.fd != channel.fd or cq.cq.channel != channel.cc:
            raise RuntimeError("pyverbs' CQ/CompChannel layout differs from the fast path's "
                               "declarations: rebuild it (scripts/setup.sh)")
        self._cq = cq
        self._channel = channel
        self._ack_batch = max(1, ack_batch)
        self._report = report
        self.unacked = 0
        self.completions = 0
        self.wakeups = 0
        self.draining = False
        self.later = []

    def get_event(self):
        """Read one channel event if there is one (non-blocking fd); ``True`` if read."""
        cdef v.ibv_cq *cq = self._cq.cq
        cdef v.ibv_cq *ev_cq
        cdef void *ctx
        if cq == NULL or self._channel.cc == NULL:
            return False
        if v.ibv_get_cq_event(self._channel.cc, &ev_cq, &ctx):
            if errno == EAGAIN:  # (EWOULDBLOCK on Linux)
                return False
            raise OSError(errno, "ibv_get_cq_event failed")
        self.unacked += 1
        if self.unacked >= self._ack_batch:
            v.ibv_ack_cq_events(cq, self.unacked)
            self.unacked = 0
        return True

    def ack_all(self):
        """Acknowledge every event read (before the CQ is destroyed)."""
        cdef v.ibv_cq *cq = self._cq.cq
        if self.unacked and cq != NULL:
            v.ibv_ack_cq_events(cq, self.unacked)
        self.unacked = 0

    def arm(self):
        """Request an event for the next completion (``ibv_req_notify_cq``)."""
        cdef v.ibv_cq *cq = self._cq.cq
        if cq == NULL:
            raise OSError(EBADF, "the CQ is closed")
        cdef int rc = v.ibv_req_notify_cq(cq, 0)
        if rc:
            raise OSError(rc, "ibv_req_notify_cq failed")

    def drain(self, dict handlers not None, dict routes not None):
        """Poll until the CQ is empty, calling each completion's handler; return how many.

        ``wr_id`` below 2**32: a one-shot handler, popped from ``handlers``; above: the
        route ``wr_id >> 32`` in ``routes``. Stops when a handler closed the CQ. Calls
        deferred to :attr:`later` while it drained run at its end (see
        :class:`aiordma._places.Notify`); a drain inside a handler leaves them to the outer one.
        """
        if self.draining:
            return self._drain(handlers, routes)
        return self._deferring(handlers, routes, False)

    def wake(self, dict handlers not None, dict routes not None):
        """The whole wake-up: read the event, drain, re-arm, drain again (a completion that
        landed between the last poll and the arm raised no event); return how many ran.
        Counted in :attr:`wakeups`: an event loop can call this directly on the channel fd's
        readiness."""
        self.wakeups += 1
        self.get_event()
        return self._deferring(handlers, routes, True)

    cdef int _deferring(self, dict handlers, dict routes, bint rearm) except -1:
        """Drain (and with ``rearm``, re-arm and drain again) with :attr:`draining` set, then
        run the calls deferred to :attr:`later` meanwhile; how many completions ran."""
        cdef int found, rc
        self.draining = True
        try:
            found = self._drain(handlers, routes)
            if rearm and self._cq.cq != NULL:
                rc = v.ibv_req_notify_cq(self._cq.cq, 0)
                if rc:
                    raise OSError(rc, "ibv_req_notify_cq failed")
                found += self._drain(handlers, routes)
        finally:
            self.draining = False
        if self.later:
            self._run_later()
        return found

    cdef int _run_later(self) except -1:
        """Run the calls deferred during a drain, in order (one that fails is reported; the
        others still run)."""
        cdef list calls = self.later
        self.later = []
        for call in calls:
            try:
                call()
            except Exception as exc:
                self._report(exc)
        return 0

    cdef int _drain(self, dict handlers, dict routes) except -1:
        cdef v.ibv_cq *cq
        cdef int n, i, total = 0
        cdef v.ibv_wc *wc
        cdef Completion c
        cdef object h
        while True:
            cq = self._cq.cq
            if cq == NULL:
                break
            n = v.ibv_poll_cq(cq, BATCH, self._wc)
            if n < 0:
                raise OSError(-n if n < -1 else EBADF, "ibv_poll_cq failed")
            for i in range(n):
                wc = &self._wc[i]
                if wc.wr_id >= ROUTE_MIN:
                    h = routes.get(wc.wr_id >> 32)
                else:
                    h = handlers.pop(wc.wr_id, None)
                if h is None:
                    continue
                try:  # a faulty handler must not stall the others
                    if type(h) is MessageRoute and wc.status == 0:
                        (<MessageRoute>h).complete(wc.wr_id, wc.byte_len, wc.opcode,
                                                   wc.imm_data)
                    elif type(h) is StepRunner and wc.status == 0:
                        (<StepRunner>h).complete(wc.wr_id, wc.byte_len, wc.opcode,
                                                 wc.imm_data)
                    else:
                        c = Completion.__new__(Completion)
                        c.wr_id = wc.wr_id
                        c.status = wc.status
                        c.opcode = wc.opcode
                        c.vendor_err = wc.vendor_err
                        c.byte_len = wc.byte_len
                        c.imm_data = wc.imm_data
                        c.qp_num = wc.qp_num
                        c.wc_flags = wc.wc_flags
                        h(c)
                except Exception as exc:
                    self._report(exc)
                if self._cq.cq == NULL:  # it closed the CQ: the rest were failed by close
                    self.completions += i + 1
                    return total + i + 1
            total += n
            self.completions += n
            if n < BATCH:
                break
        return total


# The rest of the module, one idea per file (textually included: one compiled module).
include "_fastpath_qp.pxi"
include "_fastpath_srq.pxi"
include "_fastpath_route.pxi"
include "_fastpath_steps.pxi"
include "_fastpath_quick.pxi"
