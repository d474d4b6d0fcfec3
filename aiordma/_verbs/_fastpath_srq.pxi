# The compiled verbs fast path, continued: SRQDriver, a shared receive queue's slots.
# Included by _fastpath.pyx and compiled as one module with it (see its docstring).

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
