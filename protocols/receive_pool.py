"""The credit rules of a shared receive pool, sans-I/O: one receiver, many connections.

A receiver with a shared receive queue (SRQ) posts ``buffers`` receives once for all its
connections; a frame from any of them lands in whichever buffer is next. So no receive is ever
missing, the senders together may have at most as many frames outstanding (granted and not
yet arrived) as there are buffers posted. :class:`ReceivePool` is the receiver's bookkeeping
of that, :class:`PoolCredits` a sender's; the messages between them are the small frozen
events below, which a transport carries (on RDMA: in frames of the connection, see
``docs/receive-pool.md``).

Classes of frames
    Control frames (acknowledgements, credit returns, and :class:`Want`/:class:`Return`
    themselves) keep their per-connection window (:mod:`aiordma.protocols.messages._credits`):
    each connection *reserves* ``ctrl_reserve`` of the pool's buffers for them when it is attached,
    and they are reposted on arrival. Data frames (messages) spend *data credits*, which are
    a share of the rest of the pool that the receiver grants and takes back.

Rules (the receiver)
    1. *Safety*: the receiver grants a data credit only out of a buffer that is posted and not
       owed to anyone: ``outstanding + reserved <= posted``, where ``outstanding`` counts every
       credit granted whose frame has not arrived yet (a credit in flight towards the sender,
       held by it, or a frame in flight). A frame that arrives without an outstanding credit
       is the sender's fault (:class:`~aiordma.protocols.errors.RemoteProtocolError`).
    2. *Demand*: a sender asks with :class:`Want` (``frames``: how many more it needs); the
       receiver grants from free buffers, at most ``share_max`` per connection counting
       its outstanding credits and the buffers its frames hold (so a connection whose
       reader is slow holds at most its share of the pool: backpressure reaches its sender).
    3. *No starvation*: connections that want wait in one first-in-first-out queue, and free
       buffers go round-robin to it, one credit per connection per turn, before anyone else;
       a connection served and still wanting goes to the back. So a connection that wants
       is granted a credit after at most ``attached - 1`` other grants.
    4. *Taking back*: when connections wait and no buffer is free, the receiver sends
       :class:`Reclaim` to every connection that holds credits (even one granted in the same
       breath: a grant may answer an ask its sender no longer needs), unless it was reclaimed
       since its last frame and returned nothing (no ping-pong); such a sender
       answers :class:`Return` with every credit it cannot use now (0 when its queued frames
       need them all). A Return of credits also voids the sender's earlier asks (it has a
       surplus, so it wants nothing; it asks again when it does): a sender whose queue
       shrank cannot hold credits while it stands in line. A sender also returns credits by itself when it has nothing to send
       (:meth:`PoolCredits.idle`, above ``keep``). Returned credits free their buffers for
       the waiters.
    5. *Detach*: a connection closed (its queue pair destroyed, so nothing of it is in flight
       any more) gives back its reservation and every credit it held.

Rules (the sender, :class:`PoolCredits`)
    A data frame spends a credit; a sender short of credits for what it has queued asks for the
    difference once (:meth:`PoolCredits.want`), answers a :class:`Reclaim` with a
    :class:`Return` of what it cannot use now, and returns surplus when idle. A grant the
    sender did not expect is still kept: credits are never lost, only returned.

Liveness rests on the receiver releasing the buffers frames arrive in (an endpoint copies a
message out at once while its receive budget allows, and reposts the buffer) and on senders
answering :class:`Reclaim`; both are proven, with the safety rule, by a hypothesis state
machine in ``tests/unit/test_protocol_receive_pool.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = ["Grant", "PoolCredits", "PoolEvent", "ReceivePool", "Reclaim", "Return", "Want"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolEvent:
    """Base class of the messages between a pool's receiver and its senders."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant(PoolEvent):
    """Receiver -> sender: ``credits`` more data frames may be sent."""

    conn: Hashable
    credits: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Reclaim(PoolEvent):
    """Receiver -> sender: return the credits you cannot use now (others wait)."""

    conn: Hashable


@dataclass(frozen=True, slots=True, kw_only=True)
class Want(PoolEvent):
    """Sender -> receiver: ``frames`` more data credits are needed (added to earlier asks)."""

    frames: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Return(PoolEvent):
    """Sender -> receiver: ``credits`` unused data credits given back."""

    credits: int


class _Conn:
    __slots__ = ("held", "outstanding", "spared", "wanted")

    def __init__(self) -> None:
        self.outstanding = 0  # credits granted whose frames have not arrived
        self.held = 0  # buffers holding this connection's data frames, not yet released
        self.wanted = 0  # credits asked for and not yet granted
        # no Reclaim goes to it now: one went and was not answered with credits (until its
        # next frame or a Return of credits)
        self.spared = False


def _count(value: int, name: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise LocalProtocolError(f"{name} must be an int >= {low}, not {value!r}")
    return value


class ReceivePool:
    """A receiver's shared pool of posted receive buffers (see the module documentation).

    Args:
        buffers: receives posted in the shared queue (more may be added with :meth:`grow`).
        share_max: data credits one connection may have outstanding, plus buffers its data
            frames hold, at most.
        ctrl_reserve: buffers each attached connection reserves for its control frames.
        initial: data credits granted at attach when buffers are free (0: on demand only).

    Attributes:
        posted: buffers posted now (``buffers`` less those holding a frame not yet released).
        actions: :class:`Grant` and :class:`Reclaim` events to carry out, in order
            (:meth:`take_actions`).

    Raises:
        LocalProtocolError: an argument out of range, or a call about a connection that is
            not attached.
    """

    def __init__(self, *, buffers: int, share_max: int, ctrl_reserve: int = 3,
                 initial: int = 1) -> None:
        self.buffers = _count(buffers, "buffers", 1)
        self.share_max = _count(share_max, "share_max", 1)
        self.ctrl_reserve = _count(ctrl_reserve, "ctrl_reserve")
        self.initial = min(_count(initial, "initial"), self.share_max)
        self.held = 0  # buffers holding data frames, not yet released
        self.outstanding = 0  # sum of every connection's
        self.actions: list[PoolEvent] = []
        self._conns: dict[Hashable, _Conn] = {}
        self._waiting: deque[Hashable] = deque()

    # -- the pool's figures --------------------------------------------------------------------

    @property
    def posted(self) -> int:
        return self.buffers - self.held

    @property
    def reserved(self) -> int:
        """Buffers reserved for the attached connections' control frames."""
        return self.ctrl_reserve * len(self._conns)

    @property
    def free(self) -> int:
        """Posted buffers owed to no one: what may be granted now."""
        return self.posted - self.reserved - self.outstanding

    @property
    def waiting(self) -> int:
        """Connections waiting for a grant."""
        return len(self._waiting)

    def outstanding_of(self, conn: Hashable) -> int:
        """Data credits of ``conn`` granted whose frames have not arrived."""
        return self._conn(conn).outstanding

    def take_actions(self) -> list[PoolEvent]:
        out, self.actions = self.actions, []
        return out

    # -- connections ---------------------------------------------------------------------------

    def can_attach(self) -> bool:
        """Whether one more connection's control reservation fits the free buffers, leaving
        at least one for data (with none, every connection would wait for ever)."""
        return self.free > self.ctrl_reserve

    def attach(self, conn: Hashable) -> int:
        """A new connection: reserve its control buffers, grant it ``initial`` credits if
        they are free now; return that grant (the handshake carries it, not an action).

        Raises:
            LocalProtocolError: ``conn`` is attached already, or the pool has no room for its
                reservation (:meth:`can_attach`; :meth:`grow` the pool first).
        """
        if conn in self._conns:
            raise LocalProtocolError(f"connection {conn!r} is attached already")
        if not self.can_attach():
            raise LocalProtocolError(f"the pool has {self.free} free buffers, a connection "
                                     f"reserves {self.ctrl_reserve}: grow it first")
        c = self._conns[conn] = _Conn()
        grant = max(0, min(self.initial, self.free)) if not self._waiting else 0
        c.outstanding = grant
        self.outstanding += grant
        return grant

    def detach(self, conn: Hashable) -> None:
        """The connection is gone and nothing of it is in flight (its queue pair was
        destroyed): its reservation and outstanding credits come back. Buffers still holding
        its frames stay held until :meth:`release`."""
        c = self._conn(conn)
        self.outstanding -= c.outstanding
        del self._conns[conn]
        if c.wanted:
            self._waiting.remove(conn)
        self._distribute()

    def grow(self, buffers: int) -> None:
        """``buffers`` more receives were posted."""
        self.buffers += _count(buffers, "buffers", 1)
        self._distribute()

    # -- the receiver's inputs -----------------------------------------------------------------

    def on_frame(self, conn: Hashable) -> None:
        """A data frame of ``conn`` arrived in a pool buffer (which it now holds).

        Raises:
            RemoteProtocolError: the sender had no outstanding credit (it overran its share).
        """
        c = self._conn(conn)
        if c.outstanding <= 0:
            raise RemoteProtocolError("peer sent a data frame without a pool credit")
        c.outstanding -= 1
        self.outstanding -= 1
        c.held += 1
        self.held += 1
        c.spared = False  # it is sending: reclaim it again if need be

    def release(self, conn: Hashable | None = None) -> None:
        """A buffer that held a data frame was reposted (``conn``: whose frame it held, if it
        is still attached)."""
        if self.held <= 0:
            raise LocalProtocolError("released a pool buffer that holds no frame")
        self.held -= 1
        c = self._conns.get(conn) if conn is not None else None
        if c is not None and c.held > 0:
            c.held -= 1
        self._distribute()

    def on_want(self, conn: Hashable, event: Want) -> None:
        """The sender of ``conn`` asks for ``event.frames`` more credits."""
        c = self._conn(conn)
        if event.frames <= 0:
            raise RemoteProtocolError("a Want asks for no credits")
        if not c.wanted:
            self._waiting.append(conn)
        c.wanted += event.frames
        self._distribute()

    def on_return(self, conn: Hashable, event: Return) -> None:
        """The sender of ``conn`` gave ``event.credits`` back.

        Raises:
            RemoteProtocolError: it returned more than it was granted.
        """
        c = self._conn(conn)
        if event.credits < 0 or event.credits > c.outstanding:
            raise RemoteProtocolError(f"a Return of {event.credits} credits; "
                                      f"{c.outstanding} are outstanding")
        c.outstanding -= event.credits
        self.outstanding -= event.credits
        if event.credits:  # a surplus: it wants nothing (an ask of before is void)
            c.spared = False  # (after a Return of 0, its next frame makes it reclaimable)
            if c.wanted:
                c.wanted = 0
                self._waiting.remove(conn)
        self._distribute()

    # -- internals -----------------------------------------------------------------------------

    def _conn(self, conn: Hashable) -> _Conn:
        c = self._conns.get(conn)
        if c is None:
            raise LocalProtocolError(f"connection {conn!r} is not attached to the pool")
        return c

    def _distribute(self) -> None:
        """Free buffers to the waiting connections, round-robin; reclaim if none is free."""
        waiting = self._waiting
        if not waiting:  # (nobody to grant to or reclaim for: every released buffer's case)
            return
        grants: dict[Hashable, int] = {}
        conns, cap = self._conns, self.share_max
        free = self.free
        while waiting and free > 0:
            conn = waiting.popleft()
            c = conns[conn]
            if c.outstanding + c.held >= cap:  # at its share: it waits for its frames
                waiting.append(conn)
                if all(conns[w].outstanding + conns[w].held >= cap for w in waiting):
                    break
                continue
            c.outstanding += 1
            self.outstanding += 1
            c.wanted -= 1
            free -= 1
            grants[conn] = grants.get(conn, 0) + 1
            if c.wanted:
                waiting.append(conn)
        self.actions.extend(Grant(conn=k, credits=n) for k, n in grants.items())
        if waiting and free <= 0:
            for conn, c in conns.items():
                if c.outstanding and not c.spared:
                    c.spared = True
                    self.actions.append(Reclaim(conn=conn))

    def __repr__(self) -> str:
        return (f"<ReceivePool posted {self.posted}/{self.buffers} reserved {self.reserved} "
                f"outstanding {self.outstanding} free {self.free} "
                f"{len(self._conns)} connections, {len(self._waiting)} waiting>")


class PoolCredits:
    """A sender's data credits in a peer's receive pool.

    Args:
        initial: the credits granted at set-up.
        keep: credits an idle sender keeps rather than returning (:meth:`idle`).

    Attributes:
        credits: data frames it may send now.
        asked: credits asked for (:class:`Want`) and not yet granted.
    """

    def __init__(self, *, initial: int = 0, keep: int = 0) -> None:
        self.credits = _count(initial, "initial")
        self.keep = _count(keep, "keep")
        self.asked = 0

    def send(self) -> None:
        """Spend a credit on a data frame.

        Raises:
            LocalProtocolError: no credit.
        """
        if self.credits <= 0:
            raise LocalProtocolError("no pool credit: ask with want() and wait for a grant")
        self.credits -= 1

    def want(self, queued: int) -> Want | None:
        """``queued`` frames wait to be sent: the :class:`Want` to send for those that have
        neither a credit nor an ask out, or None."""
        need = _count(queued, "queued") - self.credits - self.asked
        if need <= 0:
            return None
        self.asked += need
        return Want(frames=need)

    def on_grant(self, event: Grant) -> None:
        if event.credits <= 0:
            raise RemoteProtocolError("a Grant of no credits")
        self.credits += event.credits
        self.asked = max(0, self.asked - event.credits)

    def on_reclaim(self, queued: int) -> Return:
        """The receiver reclaims: return every credit the ``queued`` frames do not need now
        (a Return of 0 still answers, so the receiver may reclaim again later)."""
        back = max(0, self.credits - _count(queued, "queued"))
        self.credits -= back
        if back:
            self.asked = 0  # the receiver drops the asks of a sender that returns credits
        return Return(credits=back)

    def idle(self) -> Return | None:
        """Nothing is queued: the :class:`Return` of the credits above ``keep``, or None."""
        back = self.credits - self.keep
        if back <= 0:
            return None
        self.credits -= back
        self.asked = 0  # (as on_reclaim's)
        return Return(credits=back)
