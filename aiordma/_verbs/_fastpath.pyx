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
  property setters), and receive slots from work requests built once.
- :class:`SRQDriver`: a shared receive queue's slots, built once, posted as chains.

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
from pyverbs.qp cimport QP
from pyverbs.srq cimport SRQ
cimport pyverbs.libibverbs as v

from aiordma.protocols._messages_state import Lifecycle
from aiordma.protocols.errors import ProtocolError

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
        self.draining = True
        try:
            found = self._drain(handlers, routes)
        finally:
            self.draining = False
        if self.later:
            self._run_later()
        return found

    def wake(self, dict handlers not None, dict routes not None):
        """The whole wake-up: read the event, drain, re-arm, drain again (a completion that
        landed between the last poll and the arm raised no event); return how many ran.
        Counted in :attr:`wakeups`: an event loop can call this directly on the channel fd's
        readiness."""
        self.wakeups += 1
        self.get_event()
        cdef int found, rc
        self.draining = True
        try:
            found = self._drain(handlers, routes)
            if self._cq.cq != NULL:
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
                        (<MessageRoute>h).complete(wc.wr_id, wc.byte_len)
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


cdef inline void _fill_send(v.ibv_send_wr *wr, v.ibv_sge *sge, unsigned long long wr_id,
                            int opcode, unsigned long long address, unsigned int length,
                            unsigned int lkey, unsigned int send_flags):
    """One send work request with one SGE (none when ``length`` is 0), unchained."""
    memset(wr, 0, sizeof(v.ibv_send_wr))
    sge.addr = address
    sge.length = length
    sge.lkey = lkey
    wr.wr_id = wr_id
    wr.sg_list = sge
    wr.num_sge = 1 if length else 0
    wr.opcode = <v.ibv_wr_opcode>opcode
    wr.send_flags = send_flags


cdef inline void _fill_recv(v.ibv_recv_wr *wr, v.ibv_sge *sge, unsigned long long wr_id,
                            unsigned long long address, unsigned int length, unsigned int lkey):
    """One receive work request with one SGE, unchained."""
    sge.addr = address
    sge.length = length
    sge.lkey = lkey
    wr.wr_id = wr_id
    wr.next = NULL
    wr.sg_list = sge
    wr.num_sge = 1


cdef int _build_slots(unsigned long long wr_base, unsigned long long address,
                      unsigned int slot_size, unsigned int lkey, int n,
                      v.ibv_recv_wr **rwr_out, v.ibv_sge **rsge_out) except -1:
    """``n`` receive slots' work requests (``wr_base | i``, ``address + i * slot_size``)."""
    if n <= 0:
        raise ValueError("n must be positive")
    cdef v.ibv_recv_wr *rwr = <v.ibv_recv_wr *>calloc(n, sizeof(v.ibv_recv_wr))
    cdef v.ibv_sge *rsge = <v.ibv_sge *>calloc(n, sizeof(v.ibv_sge))
    if rwr == NULL or rsge == NULL:
        free(rwr)
        free(rsge)
        raise MemoryError()
    cdef int i
    for i in range(n):
        _fill_recv(&rwr[i], &rsge[i], wr_base | <unsigned long long>i,
                   address + <unsigned long long>i * slot_size, slot_size, lkey)
    rwr_out[0], rsge_out[0] = rwr, rsge
    return 0


cdef class QPDriver:
    """Posting on one queue pair from plain integers.

    Receive slots: :meth:`prepare_slots` builds ``n`` receive work requests once (slot ``i``:
    ``wr_id = wr_base | i``, ``address + i * slot_size``); :meth:`post_slot` posts one.
    Every post returns 0 or an errno (``EBADF`` once the queue pair is closed).
    """

    cdef QP _qp
    cdef v.ibv_recv_wr *_rwr
    cdef v.ibv_sge *_rsge
    cdef int _nslots
    cdef v.ibv_send_wr *_swr  # a chain of SENDs for post_sends, grown as needed
    cdef v.ibv_sge *_ssge
    cdef Py_ssize_t _nsend, _lead  # _lead: a WRITE built at the chain's head (1) or not
    # run_actions: the action types it carries out, and where SEND frames are
    cdef object _post_send_type, _post_recv_type
    cdef unsigned long long _wr_base, _send_address
    cdef unsigned int _send_lkey, _signaled_flag
    cdef int _send_opcode

    compiled = True

    def __cinit__(self, QP qp not None):
        if qp.qp == NULL:
            raise ValueError("the queue pair is closed")
        if qp.qp.qp_num != qp.qp_num:
            raise RuntimeError("pyverbs' QP layout differs from the fast path's declarations: "
                               "rebuild it (scripts/setup.sh)")
        self._qp = qp
        self._rwr = NULL
        self._rsge = NULL
        self._nslots = 0
        self._swr = NULL
        self._ssge = NULL
        self._nsend = self._lead = 0

    def __dealloc__(self):
        self._free()

    def release(self):
        """Free the work requests built here (the queue pair is being destroyed)."""
        self._free()

    cdef void _free(self):
        free(self._rwr)
        free(self._rsge)
        free(self._swr)
        free(self._ssge)
        self._rwr, self._rsge, self._swr, self._ssge = NULL, NULL, NULL, NULL
        self._nslots, self._nsend = 0, 0

    cdef int _grow(self, Py_ssize_t n) except -1:
        """Room for a chain of ``n`` SENDs."""
        if n <= self._nsend:
            return 0
        free(self._swr)
        free(self._ssge)
        self._swr = <v.ibv_send_wr *>calloc(n, sizeof(v.ibv_send_wr))
        self._ssge = <v.ibv_sge *>calloc(n, sizeof(v.ibv_sge))
        if self._swr == NULL or self._ssge == NULL:
            free(self._swr)
            free(self._ssge)
            self._swr, self._ssge, self._nsend = NULL, NULL, 0
            raise MemoryError()
        self._nsend = n
        return 0

    cdef int _post_chain(self, Py_ssize_t n):
        """Post the first ``n`` SENDs built in the chain; 0 or an errno."""
        cdef v.ibv_qp *qp = self._qp.qp
        cdef v.ibv_send_wr *bad
        if qp == NULL:
            return EBADF
        self._swr[n - 1].next = NULL
        return v.ibv_post_send(qp, self._swr, &bad)

    def set_actions(self, post_send_type, post_recv_type, unsigned long long wr_base,
                    unsigned long long send_address, unsigned int send_lkey, int send_opcode,
                    unsigned int signaled_flag):
        """What :meth:`run_actions` carries out: actions of type ``post_send_type`` (``wr_id``,
        ``offset``, ``length``, ``signaled``: a SEND of the frame at ``send_address +
        offset``, work-request id ``wr_base | wr_id``) and ``post_recv_type`` (``slot``: a
        receive slot of :meth:`prepare_slots`)."""
        self._post_send_type, self._post_recv_type = post_send_type, post_recv_type
        self._wr_base, self._send_address, self._send_lkey = wr_base, send_address, send_lkey
        self._send_opcode, self._signaled_flag = send_opcode, signaled_flag

    cpdef object run_actions(self, list actions):
        """Carry out the message protocol's posting actions, in order: each receive repost at
        once, the SENDs as one chain (one doorbell) posted before the place of any other
        action and at the end. The other actions are returned in order (None if there are
        none) for the caller to carry out, after these posts.

        Raises:
            OSError: a post failed (its errno; those before it are posted).
        """
        if actions is None:
            raise TypeError("actions must be a list")
        cdef Py_ssize_t n = len(actions), i, nsend = self._lead  # (run_actions_led's WRITE)
        cdef object a, t
        cdef list rest = None
        cdef v.ibv_qp *qp
        cdef v.ibv_recv_wr *rbad
        cdef int rc, slot
        self._lead = 0
        self._grow(n + nsend)
        for i in range(n):
            a = actions[i]
            t = type(a)
            if t is self._post_send_type:
                _fill_send(&self._swr[nsend], &self._ssge[nsend],
                           self._wr_base | <unsigned long long>a.wr_id, self._send_opcode,
                           self._send_address + <unsigned long long>a.offset, a.length,
                           self._send_lkey, self._signaled_flag if a.signaled else 0)
                if nsend:
                    self._swr[nsend - 1].next = &self._swr[nsend]
                nsend += 1
            elif t is self._post_recv_type:
                slot = a.slot
                qp = self._qp.qp
                if qp == NULL:
                    raise OSError(EBADF, "ibv_post_recv failed: the queue pair is closed")
                if slot < 0 or slot >= self._nslots:
                    raise IndexError(f"no receive slot {slot} (of {self._nslots})")
                rc = v.ibv_post_recv(qp, &self._rwr[slot], &rbad)
                if rc:
                    raise OSError(rc, "ibv_post_recv failed")
            else:
                if nsend:
                    rc = self._post_chain(nsend)
                    nsend = 0
                    if rc:
                        raise OSError(rc, "ibv_post_send failed")
                if rest is None:
                    rest = []
                rest.append(a)
        if nsend:
            rc = self._post_chain(nsend)
            if rc:
                raise OSError(rc, "ibv_post_send failed")
        return rest

    def run_actions_led(self, list actions not None, unsigned long long wr_id, int opcode,
                        unsigned long long address, unsigned int length, unsigned int lkey,
                        unsigned int send_flags, unsigned long long remote_address,
                        unsigned int rkey, unsigned int imm_data=0):
        """:meth:`run_actions` with an RDMA work request (as :meth:`post_send` takes it) at
        the head of the first chain: a WRITE and the SEND announcing it in one doorbell."""
        self._grow(len(actions) + 1)
        _fill_send(&self._swr[0], &self._ssge[0], wr_id, opcode, address, length, lkey,
                   send_flags)
        self._swr[0].wr.rdma.remote_addr, self._swr[0].wr.rdma.rkey = remote_address, rkey
        self._swr[0].imm_data = imm_data
        self._lead = 1
        return self.run_actions(actions)

    def post_sends(self, list items not None, int opcode, unsigned int signaled_flag):
        """Post several SENDs with one ``ibv_post_send`` (a chain: one doorbell, one system
        call on rxe, instead of one per message); 0 or an errno (those before the failing one
        are posted). Each item is ``(wr_id, address, length, lkey, signaled)``."""
        cdef v.ibv_qp *qp = self._qp.qp
        cdef v.ibv_send_wr *bad
        cdef Py_ssize_t n = len(items), i
        cdef tuple item
        if qp == NULL:
            return EBADF
        if n == 0:
            return 0
        self._grow(n)
        for i in range(n):
            item = <tuple?>items[i]
            _fill_send(&self._swr[i], &self._ssge[i], item[0], opcode, item[1], item[2], item[3],
                       signaled_flag if item[4] else 0)
            self._swr[i].next = &self._swr[i + 1] if i + 1 < n else NULL
        return v.ibv_post_send(qp, self._swr, &bad)

    def prepare_slots(self, unsigned long long wr_base, unsigned long long address,
                      unsigned int slot_size, unsigned int lkey, int n):
        """Build the receive work requests of ``n`` slots (replacing earlier ones)."""
        cdef v.ibv_recv_wr *rwr
        cdef v.ibv_sge *rsge
        _build_slots(wr_base, address, slot_size, lkey, n, &rwr, &rsge)
        free(self._rwr)
        free(self._rsge)
        self._rwr, self._rsge, self._nslots = rwr, rsge, n

    def post_slot(self, int i):
        """Post receive slot ``i``; 0 or an errno."""
        cdef v.ibv_qp *qp = self._qp.qp
        cdef v.ibv_recv_wr *bad
        if qp == NULL:
            return EBADF
        if i < 0 or i >= self._nslots:
            raise IndexError(f"no receive slot {i} (of {self._nslots})")
        return v.ibv_post_recv(qp, &self._rwr[i], &bad)

    def post_recv(self, unsigned long long wr_id, unsigned long long address,
                  unsigned int length, unsigned int lkey):
        """Post one receive work request; 0 or an errno."""
        cdef v.ibv_qp *qp = self._qp.qp
        cdef v.ibv_recv_wr wr
        cdef v.ibv_recv_wr *bad
        cdef v.ibv_sge sge
        if qp == NULL:
            return EBADF
        _fill_recv(&wr, &sge, wr_id, address, length, lkey)
        return v.ibv_post_recv(qp, &wr, &bad)

    def post_send(self, unsigned long long wr_id, int opcode, unsigned long long address,
                  unsigned int length, unsigned int lkey, unsigned int send_flags,
                  unsigned long long remote_address=0, unsigned int rkey=0,
                  unsigned long long compare_add=0, unsigned long long swap=0,
                  bint atomic=False, unsigned int imm_data=0):
        """Post one send work request (one SGE, none when ``length`` is 0); 0 or an errno.

        ``atomic``: fill the atomic fields (``compare_add``, ``swap``) instead of the RDMA
        ones; plain SENDs ignore both, and all but WITH_IMM ones ``imm_data`` (as sent)."""
        cdef v.ibv_qp *qp = self._qp.qp
        cdef v.ibv_send_wr wr
        cdef v.ibv_send_wr *bad
        cdef v.ibv_sge sge
        if qp == NULL:
            return EBADF
        _fill_send(&wr, &sge, wr_id, opcode, address, length, lkey, send_flags)
        if atomic:
            wr.wr.atomic.remote_addr = remote_address
            wr.wr.atomic.rkey = rkey
            wr.wr.atomic.compare_add = compare_add
            wr.wr.atomic.swap = swap
        else:
            wr.wr.rdma.remote_addr = remote_address
            wr.wr.rdma.rkey = rkey
        wr.imm_data = imm_data
        return v.ibv_post_send(qp, &wr, &bad)


cdef class SRQDriver:
    """The receive slots of a shared receive queue, built once (as :class:`QPDriver`'s) and
    posted as chains: 0 or an errno (``EBADF`` once the queue is destroyed)."""

    cdef SRQ _srq
    cdef v.ibv_recv_wr *_rwr
    cdef v.ibv_sge *_rsge
    cdef int _nslots

    compiled = True

    def __cinit__(self, SRQ srq not None):
        if srq.srq == NULL:
            raise ValueError("the shared receive queue is closed")
        self._srq = srq
        self._rwr, self._rsge, self._nslots = NULL, NULL, 0

    def __dealloc__(self):
        self.release()

    def release(self):
        """Free the work requests built here (the queue is being destroyed)."""
        free(self._rwr)
        free(self._rsge)
        self._rwr, self._rsge, self._nslots = NULL, NULL, 0

    def prepare_slots(self, unsigned long long wr_base, unsigned long long address,
                      unsigned int slot_size, unsigned int lkey, int n):
        """Build the receive work requests of ``n`` slots (replacing earlier ones)."""
        cdef v.ibv_recv_wr *rwr
        cdef v.ibv_sge *rsge
        _build_slots(wr_base, address, slot_size, lkey, n, &rwr, &rsge)
        self.release()
        self._rwr, self._rsge, self._nslots = rwr, rsge, n

    def post_slots(self, list slots not None):
        """Post the (distinct) slots named, in order, as one chain; 0 or an errno."""
        cdef v.ibv_srq *srq = self._srq.srq
        cdef v.ibv_recv_wr *bad
        cdef Py_ssize_t n = len(slots), k
        cdef int i, prev = -1, first = -1
        if srq == NULL:
            return EBADF
        if n == 0:
            return 0
        for k in range(n):
            i = slots[k]
            if i < 0 or i >= self._nslots:
                raise IndexError(f"no receive slot {i} (of {self._nslots})")
            if prev >= 0:
                self._rwr[prev].next = &self._rwr[i]
            else:
                first = i
            prev = i
        self._rwr[prev].next = NULL
        return v.ibv_post_srq_recv(srq, &self._rwr[first], &bad)


cdef class MessageRoute:
    """An endpoint's route (the completions of its receive slots and sends), carried in C:
    each successful completion is fed to the endpoint's message protocol, the posting actions
    that follow are carried out by its queue pair's :class:`QPDriver`, and a receiver that
    waits is woken, with no Python in between. What needs more (other actions, a protocol
    that is closing, a failure) goes to the endpoint's callbacks.

    The reference, and the path where this module is not built, is
    :class:`aiordma._verbs.pydrivers.PyMessageRoute`; see it for the arguments.
    """

    cdef object _proto, _waiters, _on_failure, _on_input
    cdef QPDriver _qp
    cdef object _open, _broken, _released

    def __cinit__(self, proto not None, QPDriver qp not None, waiters not None, on_failure,
                  on_input):
        self._proto, self._qp, self._waiters = proto, qp, waiters
        self._on_failure, self._on_input = on_failure, on_input
        self._open, self._broken, self._released = (Lifecycle.OPEN, Lifecycle.BROKEN,
                                                    Lifecycle.RELEASED)

    def __call__(self, wc):
        """A work completion (or the reactor's exception at close), as any route gets."""
        if isinstance(wc, BaseException) or wc.status:
            self._on_failure(wc)
            return
        self.complete(wc.wr_id, wc.byte_len)

    cdef int complete(self, unsigned long long wr_id, unsigned int byte_len) except -1:
        cdef object proto = self._proto
        cdef object state = proto.state
        cdef object rest = None
        cdef object waiters, w
        if state is self._broken or state is self._released:
            return 0
        try:
            proto.on_completion(wr_id & 0xFFFF_FFFF, byte_len)
        except ProtocolError as exc:
            self._on_failure(exc)
            return 0
        if proto.actions:
            try:
                rest = self._qp.run_actions(proto.take_actions())
            except OSError as exc:
                self._on_failure(exc)
                return 0
        if rest is not None or proto.state is not self._open or proto.peer_total is not None:
            self._on_input(rest)
            return 0
        waiters = self._waiters
        if waiters and proto.inbox:
            while waiters:
                w = waiters.popleft()
                if not w.done():
                    w.set_result(None)
                    break
        return 0
