# Declarations for the compiled build of _credits.py (module
# aiordma.protocols.messages._credits_c), made by scripts/build_fastpath.py from the same
# source: see aiordma/_verbs/compiled.py. The Python module is the reference;
# tests/unit/test_protocol_compiled.py checks the two agree.

cdef class CreditWindow:
    cdef public Py_ssize_t local_data_slots, local_ctrl_slots, peer_data_slots, peer_ctrl_slots
    cdef public Py_ssize_t threshold, data_credits, ctrl_credits
    cdef public Py_ssize_t peer_data_credits, peer_ctrl_credits
    cdef public Py_ssize_t owed_data, owed_ctrl, held_data, held_ctrl

    cpdef bint can_send_data(self)
    cpdef tuple send_data(self)
    cpdef bint can_send_ctrl(self)
    cpdef tuple send_ctrl(self)
    cpdef bint credit_frame_needed(self)
    cpdef tuple send_credit(self)
    cdef tuple _grant(self)
    cpdef received(self, bint control, Py_ssize_t credits, Py_ssize_t ctrl_credits)
    cpdef release(self, bint control)
