"""An endpoint's message protocol, sans-I/O: what to post, what to read, what to deliver.

:class:`MessageProtocol` holds every rule of an endpoint's two-sided messages; the endpoint
(:mod:`aiordma._endpoint.endpoint`) only drives it: it feeds work completions and application calls
in, and carries the :ref:`actions <actions>` out (posting, reading, waking callers). Nothing
here touches a device, so two instances joined by a simulated device are tested with
hypothesis on any machine (``tests/unit/test_protocol_messages.py``).

Memory
    The protocol writes frames into the send region (``send_slots`` slots of ``slot_size``
    bytes) and reads frames from the receive region (``data_slots + ctrl_slots`` slots); the
    driver registers both and posts what the actions name.

Sending (:meth:`~MessageProtocol.send_data`, :meth:`~MessageProtocol.send_rts`)
    A message of at most :attr:`~MessageProtocol.eager_max` bytes (the smaller of the two
    sides' slots, less the header) is copied into a send slot as a DATA frame (*eager*); a larger one is announced by
    an RTS frame naming memory the peer RDMA-READs (*rendezvous*), and is done when the peer's
    DONE frame names its token. Messages go out in the order they were queued; a message
    waits in the queue until a send slot is free and the peer has a data credit for it
    (:class:`CreditWindow`, :mod:`aiordma.protocols.messages._credits`). DONE frames go
    first: they spend control credits, not data credits, so a reader always acknowledges.

Send slots and wake-ups
    Sends are unsignaled except every ``signal_every``-th post and whenever fewer than two
    send slots are left; a signaled completion frees the slot of every post before it (one
    queue pair completes in order). Work-request ids: bit 31 set, the low 31 bits the post's
    sequence number; a receive's id is its slot number (:func:`send_wr_id`, :func:`decode_wr_id`).

Send slots from a send arena (:mod:`aiordma.protocols.send_arena`)
    With ``send_chunk``, this side's send slots are a chunk's, shared with the chunk's other
    members: ``send_region`` is the chunk's, its own slots are its member's reserve, and when
    they are all in flight it borrows the chunk's shared slots (up to ``send_slots`` posts in
    flight), each back to the shared ones at its own completion. Fewer than two slots left
    counts the shared ones it could borrow; the post that takes its last own slot is
    signaled, and so is the last post the driver takes when a borrowed slot is in flight
    after the last signaled one (:meth:`~MessageProtocol.take_actions`).

Receiving: the buffer budget (like a socket's ``SO_RCVBUF``)
    A message that arrives is taken out of its receive slot at once (the slot is reposted and
    its credit returned) while the bytes buffered stay within ``recv_budget``: an eager
    message is copied, a rendezvous message is RDMA-READ into a buffer the endpoint owns
    (:class:`StartRead`; at most ``max_reads`` at a time), after which DONE goes back and the
    sender is free. Each buffered message counts its size plus :data:`MESSAGE_OVERHEAD`.
    Past the budget a message stays in its slot, holding the slot and its credit, until the
    application reads; once every data slot is held the peer's sends wait: that is the only
    way backpressure reaches a sender. A message larger than the whole budget is never
    buffered: it waits for a receiver. A receiver that is already waiting when a rendezvous
    message reaches it (the first ``receivers_waiting`` messages of the inbox are spoken for)
    takes it unread and READs it into its own buffer (zero-copy ``recv_into``).
    Delivery order is arrival order, which is the sender's order.

Close counts
    Each side's Close (on the control channel) says how many messages it sent; a side
    answers the peer's Close once that many have arrived (:attr:`~MessageProtocol.answer_due`)
    and reports end of stream once they are all delivered (:attr:`~MessageProtocol.at_eof`).
    The lifecycle table is :mod:`aiordma.protocols.messages._state`.

.. _actions:

Actions
    Every input may append to :attr:`MessageProtocol.actions`, which the driver drains in
    order (:meth:`~MessageProtocol.take_actions`): :class:`PostRecv` before any frame that
    grants the slot's credit, so the peer never finds a receive queue short (no RNR).

RDMA WRITE with immediate data (:meth:`~MessageProtocol.send_imm`, :meth:`~MessageProtocol.on_immediate`)
    A WRITE with immediate data takes one of the peer's receive slots as a message does, so
    it is counted as one: the sender spends a data credit on it (it carries no header, so no
    credits ride on it) and counts it in :attr:`~MessageProtocol.sent`; the receiver (which
    must have :attr:`~MessageProtocol.immediates` set, else the peer broke the rules) counts
    it as a message received, reposts the slot and owes its credit back as for a message
    taken out of its slot (within the buffer budget, counting :data:`MESSAGE_OVERHEAD`; past
    it the immediate holds its slot until read), and files an :class:`Immediate` (the value
    and the WRITE's length) in the inbox, in order among the messages. The sender posts the
    WRITE itself, once :meth:`~MessageProtocol.send_imm` reserved its credit (at once, or
    when a queued reservation's :class:`SendPosted` comes), and says so with
    :meth:`~MessageProtocol.imm_posted`; nothing queued behind it is posted before then, so
    the WRITE keeps its place among the messages.

A shared receive pool (:mod:`aiordma.protocols.receive_pool`)
    With ``pool_slots``, this side's receives come from a pool shared by many connections
    (``recv_region`` is the pool's, a completion's slot a pool slot): no receive is posted
    for it at set-up, a freed slot's :class:`PostRecv` goes back to the pool, and a data
    slot freed returns no credit: the peer's data credits are the pool's grants
    (:meth:`~MessageProtocol.grant`, carried in the credits of the headers as before, which
    start at ``pool_grant``); the peer asks with WANT frames (:class:`PoolWant`), returns
    with RETURN (:class:`PoolReturn`), and is asked to return by :meth:`reclaim` (a RECLAIM
    frame). With ``peer_pool``, this side follows its peer's pool: its data credits start at
    ``peer_pool_grant``; it asks for what its queue needs (and, once it has waited for a
    credit, for a few ahead, so that a steady sender rarely waits again), and answers RECLAIM
    with a RETURN of what its queue does not need.

Errors: :class:`~aiordma.protocols.errors.RemoteProtocolError` for anything the peer sent that breaks
a rule (the connection must then be failed); :class:`~aiordma.protocols.errors.LocalProtocolError` for
a call the state does not allow (a driver bug or misuse).

The package
    :mod:`~aiordma.protocols.messages._protocol` is the state machine (:class:`MessageProtocol`
    and the work-request ids), ``_actions`` the actions and inbox items it emits, ``_state``
    the lifecycle table (an endpoint's, which the TCP transport's
    :mod:`aiordma.protocols.tcp` shares), ``_credits`` the credit window. ``_protocol_c.pxd``
    and ``_credits_c.pxd`` declare the C types of the compiled build of ``_protocol.py`` and
    ``_credits.py`` (``scripts/build_fastpath.py``, loaded by :mod:`aiordma._verbs.compiled`).
"""

from __future__ import annotations

from ._actions import (
    EMPTY,
    READING,
    READY,
    UNREAD,
    Immediate,
    Incoming,
    PoolReturn,
    PoolWant,
    PostRecv,
    PostSend,
    SendDone,
    SendDropped,
    SendPosted,
    StartRead,
)
from ._credits import MIN_CTRL_SLOTS, CreditWindow
from ._protocol import (
    MESSAGE_OVERHEAD,
    POOL_AHEAD,
    SEND_BIT,
    MessageProtocol,
    decode_wr_id,
    send_wr_id,
)
from ._state import FLUSHING, LIVE, SENDING, Lifecycle, next_lifecycle

__all__ = [
    "EMPTY",
    "FLUSHING",
    "LIVE",
    "MESSAGE_OVERHEAD",
    "MIN_CTRL_SLOTS",
    "POOL_AHEAD",
    "READING",
    "READY",
    "SENDING",
    "SEND_BIT",
    "UNREAD",
    "CreditWindow",
    "Immediate",
    "Incoming",
    "Lifecycle",
    "MessageProtocol",
    "PoolReturn",
    "PoolWant",
    "PostRecv",
    "PostSend",
    "SendDone",
    "SendDropped",
    "SendPosted",
    "StartRead",
    "decode_wr_id",
    "next_lifecycle",
    "send_wr_id",
]
