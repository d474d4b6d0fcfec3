# The compiled verbs fast path, continued: MessageRoute, an endpoint's route.
# Included by _fastpath.pyx and compiled as one module with it (see its docstring).

cdef extern from "arpa/inet.h":
    unsigned int ntohl(unsigned int)

cdef enum:
    WC_RECV_RDMA_WITH_IMM = 129  # IBV_WC_RECV_RDMA_WITH_IMM (verbs.h; a unit test checks it)

RECV_RDMA_WITH_IMM = WC_RECV_RDMA_WITH_IMM

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
        """A work completion (or the reactor's exception at close), as any route gets: the
        receive of a WRITE with immediate data goes to the protocol's ``on_immediate`` with
        the value in host order (the protocol refuses it unless it accepts immediates)."""
        if isinstance(wc, BaseException) or wc.status:
            self._on_failure(wc)
            return
        if wc.opcode == WC_RECV_RDMA_WITH_IMM:
            self._take(wc.wr_id, wc.byte_len, True, ntohl(wc.imm_data))
        else:
            self._take(wc.wr_id, wc.byte_len, False, 0)

    cdef int complete(self, unsigned long long wr_id, unsigned int byte_len,
                      unsigned int opcode, unsigned int imm_data) except -1:
        """A successful completion, the CQ driver's direct call: a WRITE with immediate data
        goes to the protocol's ``on_immediate`` (the value in host order), as in ``__call__``."""
        if opcode == WC_RECV_RDMA_WITH_IMM:
            return self._take(wr_id, byte_len, True, ntohl(imm_data))
        return self._take(wr_id, byte_len, False, 0)

    cdef int _take(self, unsigned long long wr_id, unsigned int byte_len, bint imm,
                   unsigned int value) except -1:
        cdef object proto = self._proto
        cdef object state = proto.state
        cdef object rest = None
        cdef object waiters, w
        if state is self._broken or state is self._released:
            return 0
        try:
            if imm:
                proto.on_immediate(wr_id & 0xFFFF_FFFF, byte_len, value)
            else:
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

