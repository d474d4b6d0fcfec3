"""Credit-based flow control for an endpoint's receive slots, so a sender never causes an
RNR (receiver-not-ready) retry.

Each side posts ``data_slots + ctrl_slots`` receive slots (one receive queue: a frame lands
in whichever slot is next) and tells the peer both numbers at set-up; they are the peer's
initial credits of two classes. *Data* frames (DATA, RTS: messages) spend data credits;
*control* frames (DONE, CREDIT) spend control credits. Sending a frame spends one credit of
its class. A receiver that frees a slot reposts it and *owes* the credit of the frame's class
back; owed credits of both classes ride on the header of every frame it sends.

A data frame's slot is freed when the message is taken out of it (at once while the
receiver's buffer budget allows, else when its application reads it: that is backpressure).
A control frame's slot is freed on arrival, always, so acknowledgements (DONE) and credit
returns never wait for an application.

When there is no traffic to carry owed credits, a CREDIT frame does:

* **data credits**: as soon as the peer is known to be out of data credits, or the owed data
  credits reach ``threshold``;
* **control credits**: when at least two are owed and the peer is known to hold at most one.

One control credit is kept in reserve: DONE frames and data-credit CREDIT frames need two, a
control-credit return needs one. This is what keeps the control class live without
ping-pong: a side left with at most one control credit gets at least two back (its peer owes
them and always has the reserve to return them), and returning them costs the peer one,
which is fewer than the two that would make the first side return it at once. Control slots
must therefore number at least :data:`MIN_CTRL_SLOTS`. The data class is live as before:
a side out of data credits has used every grant, and each data frame it sent returned the
control credits of the CREDIT frames received before it.

:class:`CreditWindow` is pure bookkeeping (sans-I/O); the endpoint calls it on every send,
receive and release, and it raises typed errors on overrun or over-grant.
"""

from __future__ import annotations

from ..errors import LocalProtocolError, RemoteProtocolError

__all__ = ["MIN_CTRL_SLOTS", "CreditWindow"]

MIN_CTRL_SLOTS = 3
"""The fewest control slots a side may post: two for a DONE or CREDIT frame, one reserve."""


class CreditWindow:
    """One side's credits, both ways.

    Args:
        local_data_slots, local_ctrl_slots: slots this side posted (the peer's initial credits).
        peer_data_slots, peer_ctrl_slots: slots the peer posted (this side's initial credits).
        threshold: owed data credits that justify a CREDIT frame on their own
            (default: half the local data slots).

    Attributes:
        data_credits, ctrl_credits: frames of each class this side may send now.
        owed_data, owed_ctrl: freed local slots not yet returned to the peer.
        peer_data_credits, peer_ctrl_credits: what the peer may still send, as far as this side
            knows (frames in flight make the truth smaller, never larger).
    """

    def __init__(self, *, local_data_slots: int, local_ctrl_slots: int, peer_data_slots: int,
                 peer_ctrl_slots: int, threshold: int | None = None) -> None:
        for name, v, low in (("local_data_slots", local_data_slots, 1),
                             ("local_ctrl_slots", local_ctrl_slots, MIN_CTRL_SLOTS),
                             ("peer_data_slots", peer_data_slots, 1),
                             ("peer_ctrl_slots", peer_ctrl_slots, MIN_CTRL_SLOTS)):
            if v < low:
                raise LocalProtocolError(f"{name} must be at least {low}, not {v}")
        self.local_data_slots, self.local_ctrl_slots = local_data_slots, local_ctrl_slots
        self.peer_data_slots, self.peer_ctrl_slots = peer_data_slots, peer_ctrl_slots
        self.threshold = threshold if threshold is not None else max(1, local_data_slots // 2)
        self.data_credits, self.ctrl_credits = peer_data_slots, peer_ctrl_slots
        self.peer_data_credits, self.peer_ctrl_credits = local_data_slots, local_ctrl_slots
        self.owed_data = self.owed_ctrl = 0
        self.held_data = self.held_ctrl = 0  # local slots holding frames not yet released

    # -- sending -------------------------------------------------------------------------------

    def can_send_data(self) -> bool:
        return self.data_credits > 0

    def send_data(self) -> tuple[int, int]:
        """Spend a data credit; return the ``(credits, ctrl_credits)`` to put in the header."""
        if self.data_credits <= 0:
            raise LocalProtocolError("no data credit: the peer has no free receive slot")
        self.data_credits -= 1
        return self._grant()

    def can_send_ctrl(self) -> bool:
        """Whether a DONE frame may go now (two control credits: one stays in reserve)."""
        return self.ctrl_credits > 1

    def send_ctrl(self) -> tuple[int, int]:
        """Spend a control credit on a DONE frame; return the credits it carries."""
        if self.ctrl_credits <= 1:
            raise LocalProtocolError("no control credit for a DONE frame (one is the reserve)")
        self.ctrl_credits -= 1
        return self._grant()

    def credit_frame_needed(self) -> bool:
        """Whether a CREDIT frame should go now (and can)."""
        if self.owed_data > 0 and self.ctrl_credits > 1 and (
                self.peer_data_credits == 0 or self.owed_data >= self.threshold):
            return True
        # The peer may be waiting for control credits (with its last one in reserve).
        return self.owed_ctrl > 1 and self.ctrl_credits > 0 and self.peer_ctrl_credits <= 1

    def send_credit(self) -> tuple[int, int]:
        """Spend a control credit on a CREDIT frame; return the credits it carries.

        Call it when :meth:`credit_frame_needed` says so: a CREDIT frame returning control
        credits may use the reserve.
        """
        if self.ctrl_credits <= 0:
            raise LocalProtocolError("no control credit for a CREDIT frame")
        self.ctrl_credits -= 1
        return self._grant()

    def _grant(self) -> tuple[int, int]:
        data, ctrl = self.owed_data, self.owed_ctrl
        self.owed_data = self.owed_ctrl = 0
        self.peer_data_credits += data
        self.peer_ctrl_credits += ctrl
        return data, ctrl

    # -- receiving -----------------------------------------------------------------------------

    def received(self, control: bool, credits: int, ctrl_credits: int) -> None:
        """A frame arrived in one of our slots, returning ``credits``/``ctrl_credits``.

        Raises:
            RemoteProtocolError: the peer sent without a credit (overrun) or returned more
                credits than it has slots.
        """
        if control:
            if self.peer_ctrl_credits <= 0:
                raise RemoteProtocolError("peer sent a control frame without a control credit")
            self.peer_ctrl_credits -= 1
            self.held_ctrl += 1
        else:
            if self.peer_data_credits <= 0:
                raise RemoteProtocolError("peer sent a data frame without a data credit")
            self.peer_data_credits -= 1
            self.held_data += 1
        self.data_credits += credits
        self.ctrl_credits += ctrl_credits
        if self.data_credits > self.peer_data_slots or self.ctrl_credits > self.peer_ctrl_slots:
            raise RemoteProtocolError("peer returned more credits than it has receive slots")

    def release(self, control: bool) -> None:
        """A local slot was freed (and reposted): its credit is owed to the peer."""
        if control:
            if self.held_ctrl <= 0:
                raise LocalProtocolError("released a control slot that holds no frame")
            self.held_ctrl -= 1
            self.owed_ctrl += 1
        else:
            if self.held_data <= 0:
                raise LocalProtocolError("released a data slot that holds no frame")
            self.held_data -= 1
            self.owed_data += 1

    def __repr__(self) -> str:
        return (f"<CreditWindow send {self.data_credits}+{self.ctrl_credits} owed "
                f"{self.owed_data}+{self.owed_ctrl} peer {self.peer_data_credits}+"
                f"{self.peer_ctrl_credits}>")
