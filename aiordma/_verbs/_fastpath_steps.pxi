# The compiled verbs fast path, continued: StepRunner, the executor of step programs.
# Included by _fastpath.pyx and compiled as one module with it (see its docstring).

from aiordma._errors import BrokenResourceError as _Broken, RemoteProtocolError as _Remote
from aiordma.protocols.collectives._programs import step_clash, step_mismatch

cdef int PROGRAM_MAX = 127  # (the immediate value's 7 bits: protocols.collectives._programs)

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from libc.string cimport memcmp, memcpy

cdef extern from "arpa/inet.h":
    unsigned int htonl(unsigned int)

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<time.h>" nogil:
    ctypedef struct aio_timespec "struct timespec":
        long tv_sec
        long tv_nsec
    int aio_clock_gettime "clock_gettime"(int, aio_timespec *)
    int AIO_CLOCK_MONOTONIC "CLOCK_MONOTONIC"


cdef inline double _monotonic() nogil:
    cdef aio_timespec ts
    aio_clock_gettime(AIO_CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9

# Typed reduction loops: numpy's results bit for bit (integers wrap, computed unsigned; a
# float min/max keeps a NaN from either side, and the second operand when they compare equal
# (0.0 and -0.0), as numpy's minimum/maximum do). dtype codes: 0 f4, 1 f8, 2-5 i1-i8,
# 6-9 u1-u8; op codes: 0 sum, 1 prod, 2 min, 3 max, 4 band, 5 bor, 6 bxor.
cdef extern from *:
    """
    #include <stdint.h>
    #include <stddef.h>
    #define AIO_EACH(T, EXPR) do { const T *x = (const T *)a, *y = (const T *)b; \
        T *z = (T *)out; size_t n = nbytes / sizeof(T); \
        for (size_t i = 0; i < n; i++) { T p = x[i], q = y[i]; z[i] = (EXPR); } } while (0)
    #define AIO_FLOAT(T) switch (op) { \
        case 0: AIO_EACH(T, p + q); return 0; \
        case 1: AIO_EACH(T, p * q); return 0; \
        case 2: AIO_EACH(T, (p < q || p != p) ? p : q); return 0; \
        case 3: AIO_EACH(T, (p > q || p != p) ? p : q); return 0; \
        default: return -1; }
    #define AIO_INT(T, U) switch (op) { \
        case 0: AIO_EACH(T, (T)((U)p + (U)q)); return 0; \
        case 1: AIO_EACH(T, (T)((U)p * (U)q)); return 0; \
        case 2: AIO_EACH(T, p <= q ? p : q); return 0; \
        case 3: AIO_EACH(T, p >= q ? p : q); return 0; \
        case 4: AIO_EACH(T, p & q); return 0; \
        case 5: AIO_EACH(T, p | q); return 0; \
        case 6: AIO_EACH(T, p ^ q); return 0; \
        default: return -1; }
    static int aio_reduce(int op, int dt, const void *a, const void *b, void *out,
                          size_t nbytes) {
        switch (dt) {
        case 0: AIO_FLOAT(float)
        case 1: AIO_FLOAT(double)
        case 2: AIO_INT(int8_t, uint8_t)
        case 3: AIO_INT(int16_t, uint16_t)
        case 4: AIO_INT(int32_t, uint32_t)
        case 5: AIO_INT(int64_t, uint64_t)
        case 6: AIO_INT(uint8_t, uint8_t)
        case 7: AIO_INT(uint16_t, uint16_t)
        case 8: AIO_INT(uint32_t, uint32_t)
        case 9: AIO_INT(uint64_t, uint64_t)
        default: return -1;
        }
    }
    """
    int aio_reduce(int op, int dt, const void *a, const void *b, void *out,
                   size_t nbytes) nogil


def reduce_into(int op, int dtype, a, b, out):
    """``out = a (op) b`` by the typed loops the step runner uses (codes as above), over whole
    contiguous buffers of the same length (for the differential tests against numpy)."""
    cdef Py_buffer ba, bb, bo
    PyObject_GetBuffer(a, &ba, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(b, &bb, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(out, &bo, PyBUF_SIMPLE | PyBUF_WRITABLE)
            try:
                if ba.len != bb.len or ba.len != bo.len:
                    raise ValueError("the buffers differ in length")
                if aio_reduce(op, dtype, ba.buf, bb.buf, bo.buf, <size_t>ba.len):
                    raise ValueError(f"no loop for op {op}, dtype {dtype}")
            finally:
                PyBuffer_Release(&bo)
        finally:
            PyBuffer_Release(&bb)
    finally:
        PyBuffer_Release(&ba)

cdef enum:
    STEP_PUT = 0
    STEP_WAIT = 1
    STEP_REDUCE = 2
    STEP_FWD = 3
    STEP_SIGNAL = 4
    STEP_RECV_BIT = 0x40000000

cdef struct Step:
    int kind
    int a, b, c, d, e

cdef struct Arrival:
    int present
    int peer
    unsigned int sig
    unsigned int nbytes
    int prog  # the writer's program (its immediate value's bits 9-15)


cdef class StepRunner:
    """One rank's step programs carried in C (a call runs one of them): its WRITEs posted, its peers' WRITEs taken as
    their receive completions arrive, the reducers called, with no Python between steps.

    The reference, and the path where this module is not built or a queue pair is pyverbs',
    is :class:`aiordma._verbs.pysteps.PyStepRunner`; see it for the arguments. The reactor's
    CQ driver hands it each successful completion directly (:meth:`complete`); failures and
    the reactor's close come through ``__call__``.
    """

    cdef Step *_all  # every program's steps, back to back
    cdef Step *_steps  # the call's program's
    cdef int _nsteps, _landings, _npeers, _nprograms
    cdef int *_pstart
    cdef int *_plen
    cdef int *_res  # every program's results as kind << 16 | index, back to back
    cdef int *_rstart
    cdef int *_rlen
    cdef int *_pblocks  # the program's input: blocks in work buffers 0 .. blocks-1 (0: one)
    cdef char *_psized
    cdef bint _sized
    cdef unsigned int *_landed
    cdef Arrival *_arrived
    cdef list _drivers  # QPDriver by peer rank (None where none)
    cdef unsigned long long *_raddr
    cdef unsigned int *_rkey
    cdef unsigned long long *_rcap
    cdef unsigned long long _work, _land, _cap
    cdef unsigned int _lkey, _land_lkey
    cdef public unsigned long long wr_base
    cdef int _pc, _outstanding, _next_reducer, _parity, _op, _dtype, _results, _nres
    cdef int _program
    cdef list _names  # the programs' names, for errors
    cdef bint _running, _has_dst
    cdef Py_buffer _dst
    cdef unsigned int _nbytes, _sig
    cdef object _reducers, _future
    cdef public object failure
    cdef public unsigned long long calls
    cdef readonly bint compiled

    def __cinit__(self, programs, int landings, dict qps not None, dict remote not None,
                  unsigned long long work_address, unsigned int work_lkey,
                  unsigned long long land_address, unsigned long long cap,
                  unsigned long long wr_base, unsigned int land_lkey=0):
        cdef list steps = [tuple(st) for prog in programs for st in prog.steps]
        cdef int i, n = len(steps), p, k, at = 0, rat = 0
        cdef int nres = sum(len(prog.results) for prog in programs)
        cdef tuple s
        self.compiled = True
        self._nprograms = len(programs)
        self._landings = landings
        self._npeers = max(qps) + 1 if qps else 0
        self._all = <Step *>calloc(max(n, 1), sizeof(Step))
        self._pstart = <int *>calloc(max(self._nprograms, 1), sizeof(int))
        self._plen = <int *>calloc(max(self._nprograms, 1), sizeof(int))
        self._res = <int *>calloc(max(nres, 1), sizeof(int))
        self._rstart = <int *>calloc(max(self._nprograms, 1), sizeof(int))
        self._rlen = <int *>calloc(max(self._nprograms, 1), sizeof(int))
        self._pblocks = <int *>calloc(max(self._nprograms, 1), sizeof(int))
        self._psized = <char *>calloc(max(self._nprograms, 1), sizeof(char))
        self._landed = <unsigned int *>calloc(max(landings, 1), sizeof(unsigned int))
        self._arrived = <Arrival *>calloc(2 * landings + 1, sizeof(Arrival))
        self._raddr = <unsigned long long *>calloc(self._npeers + 1, sizeof(unsigned long long))
        self._rkey = <unsigned int *>calloc(self._npeers + 1, sizeof(unsigned int))
        self._rcap = <unsigned long long *>calloc(self._npeers + 1, sizeof(unsigned long long))
        if (self._all == NULL or self._arrived == NULL or self._raddr == NULL
                or self._rkey == NULL or self._rcap == NULL or self._pstart == NULL
                or self._plen == NULL or self._res == NULL or self._rstart == NULL
                or self._rlen == NULL or self._pblocks == NULL or self._psized == NULL
                or self._landed == NULL):
            raise MemoryError()
        for i in range(n):
            s = steps[i]
            self._all[i].kind = s[0]
            self._all[i].a = s[1]
            self._all[i].b = s[2]
            self._all[i].c = s[3] if len(s) > 3 else 0
            self._all[i].d = s[4] if len(s) > 4 else 0
            self._all[i].e = s[5] if len(s) > 5 else 0
        for k in range(self._nprograms):
            prog = programs[k]
            self._pstart[k], self._plen[k] = at, len(prog.steps)
            at += len(prog.steps)
            self._psized[k] = 1 if prog.sized else 0
            self._pblocks[k] = getattr(prog, "blocks", 0)
            self._rstart[k], self._rlen[k] = rat, len(prog.results)
            for kind, index in prog.results:
                self._res[rat] = kind << 16 | index
                rat += 1
        self._steps, self._nsteps = self._all, 0
        self._names = [getattr(prog, "name", "") or f"program {index}"
                       for index, prog in enumerate(programs)]
        self._program = 0
        self._drivers = [None] * self._npeers
        for p, d in qps.items():
            self._drivers[p] = <QPDriver?>d
            self._raddr[p], self._rkey[p], self._rcap[p] = remote[p]
        self._work, self._lkey, self._land, self._cap = work_address, work_lkey, land_address, cap
        self._land_lkey = land_lkey
        self.wr_base = wr_base
        self._pc = 0
        self._reducers = ()
        self.calls = 0

    def __dealloc__(self):
        if self._has_dst:
            PyBuffer_Release(&self._dst)
        free(self._all)
        free(self._pstart)
        free(self._plen)
        free(self._res)
        free(self._rstart)
        free(self._rlen)
        free(self._pblocks)
        free(self._psized)
        free(self._landed)
        free(self._arrived)
        free(self._raddr)
        free(self._rkey)
        free(self._rcap)

    cdef v.ibv_qp *_qp(self, int peer) except? NULL:
        cdef QPDriver d = <QPDriver>self._drivers[peer]
        if d is None or d._qp.qp == NULL:
            raise OSError(EBADF, f"the queue pair to rank {peer} is closed")
        return d._qp.qp

    cdef int _post_recv(self, int peer) except -1:
        cdef v.ibv_recv_wr wr
        cdef v.ibv_recv_wr *bad
        cdef v.ibv_sge sge
        cdef v.ibv_qp *qp = self._qp(peer)
        _fill_recv(&wr, &sge, self.wr_base | STEP_RECV_BIT | <unsigned long long>peer, 0, 0, 0)
        cdef int rc = v.ibv_post_recv(qp, &wr, &bad)
        if rc:
            raise OSError(rc, "ibv_post_recv failed")
        return 0

    def post_receives(self, int count):
        """Post ``count`` receives on each queue pair (once, before the peers may write)."""
        cdef int p, i
        for p in range(self._npeers):
            if self._drivers[p] is not None:
                for i in range(count):
                    self._post_recv(p)

    def start(self, int program, unsigned int nbytes, unsigned long long signature, reducers,
              future, src=None, dst=None, int op=-1, int dtype=-1, bytes tail=None):
        """As :meth:`PyStepRunner.start`, and, in C: ``src`` (a contiguous buffer of
        ``nbytes``, or, for a program staging ``blocks``, of that many blocks of ``nbytes``)
        copied into work buffer 0 (or each block into its buffer) first, followed there by
        ``tail`` if given (a one-block program: ``src`` and ``tail`` make ``nbytes``); the
        results (of a sized program with some) copied back to back into ``dst`` (a
        contiguous buffer of ``nbytes`` per result) before ``future`` is done; with ``op`` and
        ``dtype`` (``reduce_into``'s codes) the reductions by the typed loops instead of
        ``reducers``."""
        self._start(program, nbytes, signature, reducers, future, src, dst, op, dtype, tail)

    cdef int _start(self, int program, unsigned int nbytes, unsigned long long signature,
                    reducers, future, src, dst, int op, int dtype, bytes tail) except -1:
        """:meth:`start`; ``future`` may be None (:class:`QuickCore`'s calls: the call's
        outcome is then :attr:`failure` once it is not running, or a future given later)."""
        cdef Py_buffer b
        cdef int i, blocks
        cdef Py_ssize_t tlen = len(tail) if tail is not None else 0
        if self.failure is not None:
            if future is not None:
                future.set_exception(self.failure)
            return 0
        if self._running:
            raise RuntimeError("a step runner runs one call at a time")
        if not 0 <= program < self._nprograms:
            raise ValueError(f"no program {program}")
        if dst is not None and (self._rlen[program] == 0 or not self._psized[program]):
            raise ValueError("dst needs a sized program with results")
        self._steps, self._nsteps = self._all + self._pstart[program], self._plen[program]
        self._sized = self._psized[program]
        self._results, self._nres = self._rstart[program], self._rlen[program]
        if src is not None:
            blocks = max(self._pblocks[program], 1)
            PyObject_GetBuffer(src, &b, PyBUF_SIMPLE)
            try:
                if tail is not None:
                    if blocks != 1 or b.len + tlen != <Py_ssize_t>nbytes:
                        raise ValueError(f"src holds {b.len} B and the tail {tlen}, not "
                                         f"{nbytes} in one block")
                    memcpy(<void *>self._work, b.buf, b.len)
                    memcpy(<void *>(self._work + <unsigned long long>b.len),
                           <const char *>tail, tlen)
                elif b.len != <Py_ssize_t>nbytes * blocks:
                    raise ValueError(f"src holds {b.len} B, not {blocks} x {nbytes}")
                else:
                    for i in range(blocks):
                        memcpy(<void *>(self._work + <unsigned long long>i * self._cap),
                               <char *>b.buf + <Py_ssize_t>i * nbytes, nbytes)
            finally:
                PyBuffer_Release(&b)
        if dst is not None:
            PyObject_GetBuffer(dst, &self._dst, PyBUF_SIMPLE | PyBUF_WRITABLE)
            self._has_dst = True
            if self._dst.len != <Py_ssize_t>nbytes * self._nres:
                self._release_dst()
                raise ValueError(f"dst holds {self._dst.len} B, not {self._nres} x {nbytes}")
        self._op, self._dtype = op, dtype
        self._nbytes, self._sig, self._parity = nbytes, signature & 0xFFFF, self.calls & 1
        self._program = program
        self._reducers, self._next_reducer = reducers, 0
        self._future, self._pc, self._running = future, 0, True
        self.calls += 1
        cdef int base = self._parity * self._landings
        for i in range(self._landings):  # (WRITEs for this call that came first)
            if self._arrived[base + i].present and self._differs(&self._arrived[base + i]):
                self.fail(self._mismatch(i, &self._arrived[base + i]))
                return 0
        self._advance()
        return 0

    cdef inline bint _differs(self, Arrival *got):
        """A WRITE for this call's parity from another program or another collective."""
        return got.sig != self._sig or got.prog != min(self._program, PROGRAM_MAX)

    cdef object _mismatch(self, int landing, Arrival *got):
        return _Remote(step_mismatch(got.peer, landing, self._name(got.prog), got.sig,
                                     self._name(self._program), self._sig))

    cdef object _name(self, int program):
        if program < min(len(self._names), PROGRAM_MAX):
            return self._names[program]
        return "collective"

    cdef int _advance(self) except -1:
        cdef Step *s
        cdef int base = self._parity * self._landings
        cdef Arrival *got
        try:
            while self._pc < self._nsteps:
                s = &self._steps[self._pc]
                if s.kind == STEP_PUT:  # (PUT, peer, buf, landing)
                    self._write(s.a, self._work + <unsigned long long>s.b * self._cap,
                                self._nbytes, self._lkey, s.c, base)
                elif s.kind == STEP_FWD:  # (FWD, peer, src, landing)
                    self._write(s.a, self._land + <unsigned long long>(base + s.b) * self._cap,
                                self._landed[s.b], self._land_lkey, s.c, base)
                elif s.kind == STEP_SIGNAL:  # (SIGNAL, peer, landing)
                    self._write(s.a, 0, 0, 0, s.b, base)
                elif s.kind == STEP_WAIT:  # (WAIT, peer, landing)
                    got = &self._arrived[base + s.b]
                    if not got.present:
                        return 0  # (the receive's completion runs the rest)
                    got.present = 0
                    self._landed[s.b] = got.nbytes
                    if self._differs(got):
                        raise self._mismatch(s.b, got)
                    if (got.peer != s.a
                            or (self._sized and got.nbytes != self._nbytes)):
                        raise _Remote(
                            f"rank {got.peer} wrote {got.nbytes} B of a collective with "
                            f"signature {got.sig:#06x} into landing {s.b}; this rank expected "
                            f"{self._nbytes} B with {self._sig:#06x} from rank {s.a}")
                elif self._op >= 0:  # (REDUCE, kind_a, a, kind_b, b, buf)
                    if aio_reduce(self._op, self._dtype, self._at(s.a, s.b, base),
                                  self._at(s.c, s.d, base), self._at(0, s.e, base),
                                  self._nbytes):
                        raise ValueError(f"no loop for op {self._op}, dtype {self._dtype}")
                else:
                    self._reducers[self._next_reducer]()
                    self._next_reducer += 1
                self._pc += 1
            self._maybe_done()
        except Exception as exc:
            self.fail(exc)
        return 0

    def spin(self, CQDriver cq not None, dict handlers not None, dict routes not None,
             double budget):
        """Poll ``cq`` (the reactor's, with its ``handlers`` and ``routes``: every completion
        found is dispatched as a wake-up would) while this runner's call runs, for at most
        ``budget`` seconds, yielding the CPU after a poll that found nothing; return whether
        the call is over. On rxe a completion caught this way comes hundreds of microseconds
        before the channel's event would wake the loop."""
        return self._spin(cq, handlers, routes, budget)

    cdef bint _spin(self, CQDriver cq, dict handlers, dict routes, double budget) except -1:
        cdef double deadline = _monotonic() + budget
        cdef int found
        while self._running:
            if cq.draining:
                found = cq._drain(handlers, routes)
            else:
                found = cq._deferring(handlers, routes, False)
            if not self._running or _monotonic() >= deadline:
                break
            if not found:
                sched_yield()
        return not self._running

    def result_into(self, int result, dst, bytes tail not None):
        """Copy the last call's result ``result`` (an index into its program's results) into
        ``dst`` (a writable contiguous buffer) if it is ``len(dst)`` bytes followed by
        ``tail``; whether it was (else nothing is copied). Its size: what landed, or, for a
        work buffer, the call's ``nbytes``."""
        return self._result_into(result, dst, tail)

    cdef bint _result_into(self, int result, dst, bytes tail) except -1:
        cdef Py_buffer b
        if self._running:
            raise RuntimeError("the call is still running")
        if not 0 <= result < self._nres:
            raise IndexError(result)
        PyObject_GetBuffer(dst, &b, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            if not self._fits(result, b.len, tail):
                return False
            memcpy(b.buf, self._result_at(result), b.len)
            return True
        finally:
            PyBuffer_Release(&b)

    def results_into(self, dst, bytes tail not None):
        """Every result of the last call at once, as :meth:`result_into` each: into ``dst``,
        a list of one writable contiguous buffer per result, or one such buffer of as many
        rows of equal size (an allgather's ``out``), if every result is its buffer's (or
        row's) size followed by ``tail``; whether they were (else nothing is copied)."""
        return self._results_into(dst, tail)

    cdef bint _results_into(self, dst, bytes tail) except -1:
        cdef Py_buffer b
        cdef Py_ssize_t row, i
        if self._running:
            raise RuntimeError("the call is still running")
        if type(dst) is list:
            if len(<list>dst) != self._nres:
                raise ValueError(f"{len(<list>dst)} buffers for {self._nres} results")
            for i in range(self._nres):  # (every result checked before any is copied)
                PyObject_GetBuffer((<list>dst)[i], &b, PyBUF_SIMPLE | PyBUF_WRITABLE)
                row = b.len
                PyBuffer_Release(&b)
                if not self._fits(i, row, tail):
                    return False
            for i in range(self._nres):
                PyObject_GetBuffer((<list>dst)[i], &b, PyBUF_SIMPLE | PyBUF_WRITABLE)
                try:
                    memcpy(b.buf, self._result_at(i), b.len)
                finally:
                    PyBuffer_Release(&b)
            return True
        PyObject_GetBuffer(dst, &b, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            if self._nres == 0 or b.len % self._nres:
                raise ValueError(f"dst holds {b.len} B: not {self._nres} equal rows")
            row = b.len // self._nres
            for i in range(self._nres):
                if not self._fits(i, row, tail):
                    return False
            for i in range(self._nres):
                memcpy(<char *>b.buf + i * row, self._result_at(i), row)
            return True
        finally:
            PyBuffer_Release(&b)

    cdef char *_result_at(self, Py_ssize_t i):
        cdef int r = self._res[self._results + i]
        return <char *>self._at(r >> 16, r & 0xFFFF, self._parity * self._landings)

    cdef bint _fits(self, Py_ssize_t i, Py_ssize_t size, bytes tail):
        """Whether result ``i`` of the last call is ``size`` bytes followed by ``tail``."""
        cdef int r = self._res[self._results + i]
        cdef unsigned int n = self._nbytes if r >> 16 == 0 else self._landed[r & 0xFFFF]
        cdef Py_ssize_t tlen = len(tail)
        return (<Py_ssize_t>n == size + tlen
                and memcmp(self._result_at(i) + size, <const char *>tail, tlen) == 0)

    def landed(self, int landing):
        """The bytes written into ``landing`` in the last call that waited on it."""
        if not 0 <= landing < self._landings:
            raise IndexError(landing)
        return self._landed[landing]

    cdef int _write(self, int peer, unsigned long long address, unsigned int length,
                    unsigned int lkey, int landing, int base) except -1:
        """One RDMA WRITE with immediate data into ``peer``'s landing ``landing``."""
        cdef v.ibv_send_wr wr
        cdef v.ibv_send_wr *bad
        cdef v.ibv_sge sge
        cdef unsigned int imm = (<unsigned int>landing | (<unsigned int>self._parity << 8)
                                 | (<unsigned int>min(self._program, PROGRAM_MAX) << 9)
                                 | (self._sig << 16))
        _fill_send(&wr, &sge, self.wr_base | <unsigned long long>peer,
                   e.IBV_WR_RDMA_WRITE_WITH_IMM, address, length, lkey, e.IBV_SEND_SIGNALED)
        wr.wr.rdma.remote_addr = (self._raddr[peer]
                                  + <unsigned long long>(base + landing) * self._rcap[peer])
        wr.wr.rdma.rkey = self._rkey[peer]
        wr.imm_data = htonl(imm)
        cdef int rc = v.ibv_post_send(self._qp(peer), &wr, &bad)
        if rc:
            raise OSError(rc, "ibv_post_send failed")
        self._outstanding += 1
        return 0

    cdef inline void *_at(self, int kind, int i, int base):
        """Where a step's operand is: work buffer ``i`` or landing ``i`` (of this parity)."""
        if kind == 0:
            return <void *>(self._work + <unsigned long long>i * self._cap)
        return <void *>(self._land + <unsigned long long>(base + i) * self._cap)

    cdef void _release_dst(self):
        if self._has_dst:
            self._has_dst = False
            PyBuffer_Release(&self._dst)

    cdef int _maybe_done(self) except -1:
        cdef int i, r
        if self._running and self._pc == self._nsteps and self._outstanding == 0:
            self._running = False
            if self._has_dst:
                for i in range(self._nres):
                    r = self._res[self._results + i]
                    memcpy(<char *>self._dst.buf + <Py_ssize_t>i * self._nbytes,
                           self._at(r >> 16, r & 0xFFFF, self._parity * self._landings),
                           self._nbytes)
                self._release_dst()
            fut, self._future, self._reducers = self._future, None, ()
            if fut is not None and not fut.done():
                fut.set_result(None)
        return 0

    cdef int complete(self, unsigned long long wr_id, unsigned int byte_len,
                      unsigned int opcode, unsigned int imm_data) except -1:
        """A successful completion of this runner's range, the CQ driver's direct call."""
        cdef unsigned int low = wr_id & 0xFFFF_FFFF, imm, landing, parity
        cdef int peer, place
        cdef Arrival *a
        if low & STEP_RECV_BIT:
            peer = low & ~STEP_RECV_BIT
            if opcode != WC_RECV_RDMA_WITH_IMM:
                self.fail(_Remote(f"rank {peer} sent a message, not a WRITE with immediate "
                                  f"data"))
                return 0
            imm = ntohl(imm_data)
            landing, parity = imm & 0xFF, imm >> 8 & 1
            place = parity * self._landings + landing
            a = &self._arrived[place] if landing < <unsigned int>self._landings else NULL
            if a == NULL or a.present:
                if a != NULL and (a.sig != imm >> 16
                                  or a.prog != <int>(imm >> 9 & PROGRAM_MAX)):
                    self.fail(_Remote(step_clash(
                        landing, (a.peer, self._name(a.prog), a.sig),
                        (peer, self._name(imm >> 9 & PROGRAM_MAX), imm >> 16))))
                else:
                    self.fail(_Remote(f"rank {peer} wrote landing {landing} (parity {parity}) "
                                      f"out of turn"))
                return 0
            a.present, a.peer, a.sig, a.nbytes = 1, peer, imm >> 16, byte_len
            a.prog = imm >> 9 & PROGRAM_MAX
            try:
                self._post_recv(peer)
            except OSError as exc:
                self.fail(exc)
                return 0
            if self._running:
                if parity == <unsigned int>self._parity and self._differs(a):  # (the protocol)
                    self.fail(self._mismatch(landing, a))
                    return 0
                self._advance()
            return 0
        self._outstanding -= 1
        return self._maybe_done()

    def __call__(self, wc):
        """A completion (or the reactor's exception at close), as any route gets."""
        if isinstance(wc, BaseException):
            self.fail(wc)
            return
        cdef unsigned int low = wc.wr_id & 0xFFFF_FFFF
        if wc.status:
            self.fail(_Broken(
                f"a collective's {'receive from' if low & STEP_RECV_BIT else 'WRITE to'} rank "
                f"{low & ~STEP_RECV_BIT} failed (work completion status {wc.status})"))
            return
        self.complete(wc.wr_id, wc.byte_len, wc.opcode, wc.imm_data)

    def fail(self, exc):
        """Fail the call under way (if any) and every later one with ``exc``."""
        if self.failure is None:
            self.failure = exc
        self._running = False
        self._release_dst()  # (nothing is written into the caller's memory after a failure)
        fut, self._future, self._reducers = self._future, None, ()
        if fut is not None and not fut.done():
            fut.set_exception(self.failure)
