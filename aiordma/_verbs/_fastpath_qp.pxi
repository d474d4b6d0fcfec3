# The compiled verbs fast path, continued: QPDriver, a queue pair's posting; create_rc_qp.
# Included by _fastpath.pyx and compiled as one module with it (see its docstring).

import logging
import weakref

_QP_LOGGER = logging.getLogger("QP")  # (the one pyverbs' QP.__init__ would look up)


def create_rc_qp(PD pd not None, CQ cq not None, SRQ srq, unsigned int max_send_wr,
                 unsigned int max_recv_wr, unsigned int max_inline):
    """An RC queue pair in ``pd`` in RESET, its send and receive completions on ``cq``, its
    receives from ``srq`` if not None (then it has no receive queue), two send SGEs, one
    receive SGE: pyverbs' ``QP``, made as ``QP(pd, QPInitAttr(...))`` makes it (one
    ``ibv_create_qp``; ``pd``, ``cq`` and ``srq`` track it, so that closing one of them closes
    it first) without the ``QPCap``/``QPInitAttr`` objects and a logger lookup each (in the VM
    pyverbs' creation took 0.33-0.43 ms of CPU, the verbs call 0.17-0.18).

    Raises:
        OSError: the device refused the queue pair (its errno), or ``pd``, ``cq`` or ``srq``
            is closed (``EBADF``).
    """
    cdef v.ibv_qp_init_attr attr
    cdef QP qp
    if pd.pd == NULL or cq.cq == NULL or (srq is not None and srq.srq == NULL):
        raise OSError(EBADF, "the protection domain, CQ or SRQ is closed")
    memset(&attr, 0, sizeof(attr))
    attr.send_cq = cq.cq
    attr.recv_cq = cq.cq
    attr.srq = srq.srq if srq is not None else NULL
    attr.cap.max_send_wr = max_send_wr
    attr.cap.max_recv_wr = 0 if srq is not None else max_recv_wr
    attr.cap.max_send_sge = 2
    attr.cap.max_recv_sge = 1
    attr.cap.max_inline_data = max_inline
    attr.qp_type = e.IBV_QPT_RC
    attr.sq_sig_all = 0
    qp = QP.__new__(QP)  # (pyverbs' __init__ would create another; its close() is used)
    qp.logger = _QP_LOGGER
    qp.mws = weakref.WeakSet()  # (a type-1 window bound to it; Flow and DR: none on RC)
    qp.qp = v.ibv_create_qp(pd.pd, &attr)
    if qp.qp == NULL:
        raise OSError(errno, "ibv_create_qp failed")
    qp.pd = pd
    pd.add_ref(qp)
    qp.context = None
    qp.scq = cq
    cq.add_ref(qp)
    if srq is not None:
        qp.srq = srq
        srq.add_ref(qp)
    return qp

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

    def post_gather(self, unsigned long long wr_id, int opcode, unsigned long long address,
                    unsigned int length, unsigned int lkey, unsigned long long address2,
                    unsigned int length2, unsigned int lkey2, unsigned int send_flags,
                    unsigned long long remote_address, unsigned int rkey,
                    unsigned int imm_data=0):
        """Post one RDMA work request gathering two SGEs (``address``/``length``/``lkey``,
        then ``address2``/``length2``/``lkey2``) into one remote range; 0 or an errno."""
        cdef v.ibv_qp *qp = self._qp.qp
        cdef v.ibv_send_wr wr
        cdef v.ibv_send_wr *bad
        cdef v.ibv_sge sge[2]
        if qp == NULL:
            return EBADF
        _fill_send(&wr, &sge[0], wr_id, opcode, address, length, lkey, send_flags)
        sge[1].addr = address2
        sge[1].length = length2
        sge[1].lkey = lkey2
        wr.num_sge = 2
        wr.wr.rdma.remote_addr = remote_address
        wr.wr.rdma.rkey = rkey
        wr.imm_data = imm_data
        return v.ibv_post_send(qp, &wr, &bad)

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

    # -- bring-up: the RC state changes with pyverbs' masks, without its attribute objects ---

    def to_init(self, int port, unsigned int access):
        """RESET -> INIT: ``port``, P_Key index 0, the remote ``access`` accepted; 0 or an
        errno."""
        cdef v.ibv_qp_attr a
        if self._qp.qp == NULL:
            return EBADF
        memset(&a, 0, sizeof(a))
        a.qp_state = e.IBV_QPS_INIT
        a.port_num = port
        a.qp_access_flags = access
        return v.ibv_modify_qp(self._qp.qp, &a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX
                               | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)

    def to_rtr(self, int port, int path_mtu, unsigned int dest_qp_num, unsigned int rq_psn,
               int lid, object gid, int sgid_index, int max_dest_rd_atomic,
               int min_rnr_timer, int hop_limit):
        """INIT -> RTR towards ``dest_qp_num`` (``gid``: 16 bytes for a global route, as RoCE
        needs; None: by LID); 0 or an errno."""
        cdef v.ibv_qp_attr a
        cdef const unsigned char[:] raw
        cdef int i
        if self._qp.qp == NULL:
            return EBADF
        memset(&a, 0, sizeof(a))
        a.qp_state = e.IBV_QPS_RTR
        a.path_mtu = <e.ibv_mtu>path_mtu
        a.dest_qp_num = dest_qp_num
        a.rq_psn = rq_psn
        a.max_dest_rd_atomic = max_dest_rd_atomic
        a.min_rnr_timer = min_rnr_timer
        a.ah_attr.port_num = port
        a.ah_attr.dlid = lid
        if gid is not None:
            raw = gid
            if raw.shape[0] != 16:
                raise ValueError("a GID has 16 bytes")
            for i in range(16):
                a.ah_attr.grh.dgid.raw[i] = raw[i]
            a.ah_attr.is_global = 1
            a.ah_attr.grh.sgid_index = sgid_index
            a.ah_attr.grh.hop_limit = hop_limit
        return v.ibv_modify_qp(self._qp.qp, &a, e.IBV_QP_STATE | e.IBV_QP_AV
                               | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
                               | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)

    def to_rts(self, unsigned int sq_psn, int timeout, int retry_cnt, int rnr_retry,
               int max_rd_atomic):
        """RTR -> RTS: our initial PSN, the ACK timeout, retry counts, initiator depth; 0 or
        an errno."""
        cdef v.ibv_qp_attr a
        if self._qp.qp == NULL:
            return EBADF
        memset(&a, 0, sizeof(a))
        a.qp_state = e.IBV_QPS_RTS
        a.sq_psn = sq_psn
        a.timeout = timeout
        a.retry_cnt = retry_cnt
        a.rnr_retry = rnr_retry
        a.max_rd_atomic = max_rd_atomic
        return v.ibv_modify_qp(self._qp.qp, &a, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT
                               | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN
                               | e.IBV_QP_MAX_QP_RD_ATOMIC)

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
