# A group's quick collective calls, the compiled half (included by _fastpath.pyx).

from aiordma.protocols.collectives import MismatchError as _Disorder


cdef inline bint _c_order(array) except -1:
    return array.flags.c_contiguous


cdef inline bint _c_writable(array) except -1:
    flags = array.flags
    return flags.c_contiguous and flags.writeable


cdef class QuickCore:
    """The compiled half of a group's quick calls (``services/collectives/_quick.py``, whose
    :class:`QuickCalls` makes it, says which calls are quick and keeps the rest: the plans,
    the wait for a call its poll did not end, the errors' words).

    A call here is one C call from the caller's arguments to the step runner and back: the
    kind's last plan checked by identity (else :meth:`QuickCalls._plan_for`), the array's
    flags, the group's state (the engine formed and idle, nothing closed or failed), the
    call numbered (``CallOrder.start``'s own steps, where nothing was heard early), the
    runner started without a future and polled (``StepRunner._spin``), and, if that ended
    it, its outcome taken (the runner's failure), results copied out and the number
    finished. It returns None (not quick: nothing was done, the general path runs it),
    True (over), False (over; let the event loop run once: see ``_quick.UNYIELDED``) or a
    future (still running: :meth:`QuickCalls.settle` awaits it and calls :meth:`end`).
    """

    cdef object _quick, _group, _slot, _engine, _fabric, _reactor, _order
    cdef object _new_future, _empty, _history
    cdef set _on_engine, _running_calls
    cdef dict _kinds_of, _early
    cdef list _filed, _last
    cdef double _spin
    cdef int _rank, _world, _unyielded
    cdef int _k_allreduce, _k_reduce_scatter, _k_alltoall, _k_broadcast, _k_allgather
    cdef int _k_barrier
    cdef int _p_allreduce, _p_reduce_scatter, _p_alltoall, _p_allgather, _p_barrier
    cdef unsigned long long _gather_sig, _barrier_sig
    cdef StepRunner _runner  # the last call's
    cdef bint _sized
    cdef object _into, _gather
    cdef public object number  # the last call's

    def __init__(self, quick, kinds, programs, unsigned long long gather_sig,
                 unsigned long long barrier_sig, int unyielded, empty):
        """``quick``: the :class:`QuickCalls` (its group, engine and the rest are read
        once); ``kinds``: the wire kind codes of allreduce, reduce_scatter, alltoall,
        broadcast, allgather and barrier; ``programs``: the engine's programs for
        allreduce, reduce_scatter, alltoall, allgather and barrier; ``empty``: numpy's."""
        self._quick = quick
        self._group, self._slot, self._engine = quick._group, quick._slot, quick._engine
        self._fabric, self._reactor = quick._fabric, quick._reactor
        self._spin = quick._spin or 0.0
        self._new_future = quick._loop.create_future
        self._on_engine = quick._on_engine
        self._filed = quick._filed
        order = self._order = self._group._order
        self._kinds_of, self._running_calls, self._early = (order._kinds, order._running,
                                                            order._early)
        self._history = order._history
        self._rank, self._world = self._engine.rank, self._engine.world
        (self._k_allreduce, self._k_reduce_scatter, self._k_alltoall, self._k_broadcast,
         self._k_allgather, self._k_barrier) = kinds
        (self._p_allreduce, self._p_reduce_scatter, self._p_alltoall, self._p_allgather,
         self._p_barrier) = programs
        self._gather_sig, self._barrier_sig = gather_sig, barrier_sig
        self._unyielded = unyielded
        self._empty = empty
        self._last = [None] * (max(kinds) + 1)
        self.number = -1

    # -- the calls ----------------------------------------------------------------------------

    def allreduce(self, array, op):
        """``allreduce(array, op)`` in place (see the class for what it returns)."""
        cdef int kind = self._k_allreduce
        plan = self._plan_of(kind, array, op)
        if plan is None or not _c_writable(array):
            return None
        nbytes, signature, opc, code = <tuple>plan
        if not self._start(kind, True, self._p_allreduce, nbytes, signature, array, array,
                           opc, code, None):
            return None
        return self._ended()

    def reduce_scatter(self, array, op, out):
        """``reduce_scatter(array, op, out=out)``, as :meth:`allreduce`."""
        cdef int kind = self._k_reduce_scatter
        plan = self._plan_of(kind, array, op)
        if plan is None:
            return None
        nbytes, signature, opc, code, rows = <tuple>plan
        if (out.shape != rows or out.dtype != array.dtype or not _c_order(array)
                or not _c_writable(out)):
            return None
        if not self._start(kind, True, self._p_reduce_scatter, nbytes, signature, array, out,
                           opc, code, None):
            return None
        return self._ended()

    def alltoall(self, array, out):
        """``alltoall(array, out=out)``, as :meth:`allreduce`."""
        cdef int kind = self._k_alltoall
        plan = self._plan_of(kind, array, None)
        if plan is None:
            return None
        nbytes, signature = <tuple>plan
        if (out.shape != array.shape or out.dtype != array.dtype or not _c_order(array)
                or not _c_writable(out)):
            return None
        if not self._start(kind, True, self._p_alltoall, nbytes, signature, array, out, -1,
                           -1, None):
            return None
        return self._ended()

    def broadcast(self, root, array):
        """``broadcast(array, root=root)``, as :meth:`allreduce` (a plan is made only for an
        ``int`` root in range)."""
        cdef int kind = self._k_broadcast
        plan = self._plan_of(kind, array, root)
        if plan is None:
            return None
        program, signature, tail = <tuple>plan
        if <int>root == self._rank:
            if not _c_order(array):
                return None
            if not self._start(kind, False, program, array.nbytes + len(<bytes>tail),
                               signature, array, None, -1, -1, tail):
                return None
        else:
            if not _c_writable(array):
                return None
            if not self._start(kind, False, program, 0, signature, None, None, -1, -1, None):
                return None
            self._into = (root, array, tail)
        return self._ended()

    def allgather(self, array, out):
        """``allgather(array, out=out)`` (``out`` a numpy array or None): None, or what
        :meth:`allreduce` returns and where the blocks go (``out``, or a list of new
        arrays). A call whose blocks are not all of this rank's dtype and shape is left
        ``QuickCalls.open`` (see there)."""
        cdef int kind = self._k_allgather
        plan = self._plan_of(kind, array, None)
        if plan is None or not _c_order(array):
            return None
        tail, size, rows = <tuple>plan
        if out is not None:
            if not (out.shape == rows and out.dtype == array.dtype and _c_writable(out)):
                return None
            into = out  # (its rows in one copy)
        else:  # (allocated first: nothing may fail once it started)
            shape, dtype = array.shape, array.dtype
            into = [self._empty(shape, dtype) for _ in range(self._world)]
        if not self._start(kind, False, self._p_allgather, size, self._gather_sig, array,
                           None, -1, -1, tail):
            return None
        self._gather = (into, tail, (size, (self._runner.calls - 1) & 1))  # (its parity)
        return self._ended(), into

    def barrier(self):
        """A barrier, as :meth:`allreduce`."""
        if not self._start(self._k_barrier, False, self._p_barrier, 0, self._barrier_sig,
                           None, None, -1, -1, None):
            return None
        return self._ended()

    def end(self, fut):
        """Take the outcome of the call under way, once its future ``fut`` (given by a call
        here) is done: True; or False, an allgather left ``QuickCalls.open``.

        Raises:
            the call's failure, typed (the group breaks).
        """
        exc = fut.exception()
        if exc is None and (self._into is not None or self._gather is not None):
            self._engine._runner()  # (raises if the engine closed meanwhile)
        return self._end(exc, fut)

    # -- the work -----------------------------------------------------------------------------

    cdef object _plan_of(self, int kind, array, arg):
        """The kind's last plan if ``array`` has the same dtype object and shape and ``arg``
        is of the same type and equal (no dtype hashed); else ``QuickCalls._plan_for``'s."""
        dtype = array.dtype
        shape = array.shape
        last = self._last[kind]
        if last is not None:
            t = <tuple>last
            if (t[0] is dtype and type(t[2]) is type(arg) and (t[2] is arg or t[2] == arg)
                    and t[1] == shape):
                return t[3]
        plan = self._quick._plan_for(kind, dtype, shape, arg)
        self._last[kind] = (dtype, shape, arg, plan)
        return plan

    cdef bint _start(self, int kind, bint sized, int program, unsigned int nbytes,
                     unsigned long long signature, src, dst, int opc, int code,
                     tail) except -1:
        """Number the call and start it if the engine is formed and idle and the group
        neither closed nor broken (``QuickCalls``' old ``_start``); whether it started."""
        engine, slot, group, fabric = self._engine, self._slot, self._group, self._fabric
        runner = engine.runner
        if (slot.engine is not engine or slot._done != slot._turns  # (EngineSlot.idle)
                or type(runner) is not StepRunner or group._closed or fabric.closed
                or fabric.failure is not None):
            return False
        group.calls += 1  # (GroupCore._number_call)
        number = self._number_call(kind)
        self.number, self._sized, self._into, self._gather = number, sized, None, None
        if sized:  # (see GroupCore._engine_enter)
            for filed in self._filed:
                if filed:
                    self._quick._leftovers(number, kind)
                    break
            self._on_engine.add(number)
        cdef StepRunner r = <StepRunner>runner
        self._runner = r
        try:
            r._start(program, nbytes, signature, (), None, src, dst, opc, code, tail)
            if r._running and self._spin > 0:
                reactor = self._reactor
                if not reactor._closed:
                    r._spin(<CQDriver?>reactor._cq.driver, reactor._handlers, reactor._routes,
                            self._spin)
        except BaseException as exc:
            self._on_engine.discard(number)
            err = engine._typed(exc)
            fabric.fail(err)
            if err is exc:
                raise
            raise err from None
        return True

    cdef object _number_call(self, int kind):
        """``CallOrder.start(kind)`` (:func:`_order_start`), as ``GroupCore._number_call``."""
        try:
            return _order_start(self._order, self._kinds_of, self._running_calls, self._early,
                                self._history, kind)
        except _Disorder as disorder:
            raise self._group._out_of_order(disorder) from None

    cdef object _ended(self):
        """After a start: the call's future if it runs on (given to the runner now), else
        its outcome taken (see the class)."""
        cdef StepRunner runner = self._runner
        if runner._running:
            fut = self._new_future()
            runner._future = fut
            return fut
        if not self._end(runner.failure, None):
            return True  # (left open: the caller goes on at once)
        return (self.number + 1) % self._unyielded != 0

    cdef bint _end(self, exc, fut) except -1:
        """Take the outcome (``exc``: the call's failure or None) of the call under way:
        True; or False, an allgather whose blocks are not all of this rank's dtype and
        shape, left ``QuickCalls.open`` (with ``fut``, or a done future)."""
        number = self.number
        if self._sized:
            self._on_engine.discard(number)
        try:
            if exc is not None:
                raise self._engine._typed(exc) from exc.__cause__
            if self._into is not None:
                (root, array, tail), self._into = self._into, None
                if not self._runner._result_into(0, array, tail):
                    self._quick._not_like_root(root, array, tail)  # (raises)
            if self._gather is not None:
                (into, tail, state), self._gather = self._gather, None
                if not self._runner._results_into(into, tail):
                    if fut is None:
                        fut = self._new_future()
                        fut.set_result(None)
                    self._quick.open = (number, fut, state)
                    return False
        except BaseException as err:
            self._fabric.fail(err)
            raise
        self._running_calls.discard(number)  # (CallOrder.finish)
        return True


cdef object _order_start(order, dict kinds, set running, dict early, history, int kind):
    """``order.start(kind)`` (``order`` a ``CallOrder``; the others its own dicts, set and
    history): its steps here where nothing was heard early (the same state changed the same
    way: a twin, held to it by a test), else the method."""
    if early:
        return order.start(kind)
    call = order.started
    order.started = call + 1
    kinds[call] = kind
    running.add(call)
    kinds.pop(call - history, None)
    return call


def call_order_start(order, int kind):
    """:class:`QuickCore`'s numbering of a call on ``order`` (a ``CallOrder``), alone: for the
    test that holds it to ``CallOrder.start``."""
    return _order_start(order, order._kinds, order._running, order._early, order._history,
                        kind)
