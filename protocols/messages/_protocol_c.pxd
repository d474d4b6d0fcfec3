# Declarations for the compiled build of _protocol.py (module
# aiordma.protocols.messages._protocol_c), made by scripts/build_fastpath.py from the same
# source: see aiordma/_verbs/compiled.py. The Python module is the reference;
# tests/unit/test_protocol_compiled.py checks the two agree.

cimport cython

from ._credits_c cimport CreditWindow


cdef class MessageProtocol:
    cdef public CreditWindow credits
    cdef public object state
    cdef object _send, _recv
    cdef Py_ssize_t _slot, _nslots, _signal_every, _seq, _next_token, _reads
    cdef public Py_ssize_t eager_max, peer_max_message, max_message, recv_budget, max_reads
    cdef list _free, _held, _reposts, _shared
    cdef Py_ssize_t _cap, _shared_from
    cdef bint _tail_borrowed
    cdef object _last_post
    cdef object _inflight, _queue, _dones, _tickets
    cdef set _rdv_out
    cdef public object inbox, peer_total
    cdef public list actions
    cdef public Py_ssize_t buffered, reads_started, receivers_waiting, sent, received, delivered
    cdef bint _close_sent, _pool, _peer_pool, _active, _hold
    cdef public bint immediates
    cdef Py_ssize_t _asked, _ahead, _reclaims
    cdef object _returns

    cpdef list take_actions(self)
    cpdef on_completion(self, Py_ssize_t wr_id, Py_ssize_t nbytes)
    cpdef on_immediate(self, Py_ssize_t wr_id, Py_ssize_t nbytes, object value)
    cpdef send_data(self, object payload)
    cpdef pop(self)

    @cython.locals(t=Py_ssize_t)
    cdef Py_ssize_t _token(self) except -1
    @cython.locals(slot=Py_ssize_t, base=Py_ssize_t, c=Py_ssize_t, k=Py_ssize_t)
    cdef _post_data(self, object payload, Py_ssize_t n)
    @cython.locals(slot=Py_ssize_t, base=Py_ssize_t, c=Py_ssize_t, k=Py_ssize_t)
    cdef _post(self, object out)
    cdef bint _has_slot(self)
    cdef Py_ssize_t _take(self) except -1
    @cython.locals(seq=Py_ssize_t, signaled=bint, own=Py_ssize_t, borrowable=Py_ssize_t,
                   borrowed=bint)
    cdef _emit(self, Py_ssize_t slot, Py_ssize_t base, Py_ssize_t length)
    @cython.locals(slot=Py_ssize_t, base=Py_ssize_t, c=Py_ssize_t, k=Py_ssize_t,
                   cr=CreditWindow)
    cdef _pump(self)
    @cython.locals(s=Py_ssize_t, slot=Py_ssize_t, free=list, shared=list, first=Py_ssize_t)
    cdef _send_completed(self, Py_ssize_t seq)
    @cython.locals(base=Py_ssize_t, kind=Py_ssize_t, credits=Py_ssize_t, ctrl=Py_ssize_t,
                   length=Py_ssize_t, index=Py_ssize_t, cost=Py_ssize_t, start=Py_ssize_t,
                   rkey=Py_ssize_t, token=Py_ssize_t, flags=Py_ssize_t, reserved=Py_ssize_t)
    cdef _received(self, Py_ssize_t slot, Py_ssize_t nbytes)
    cdef _release(self, object item)
    cdef _free_slot(self, Py_ssize_t slot, bint control)
    cdef _short(self)
    @cython.locals(room=Py_ssize_t, spoken_for=Py_ssize_t, cost=Py_ssize_t, held=list,
                   keep=list, start=Py_ssize_t)
    cdef _refill(self)
