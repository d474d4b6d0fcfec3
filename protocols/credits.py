"""Credit-based flow control for an endpoint's receive slots, so a sender never causes an
RNR (receiver-not-ready) retry.

Each side posts ``data_slots`` receive slots for data frames (DATA, RTS, DONE) and
``ctrl_slots`` for control frames (CREDIT), and tells the peer at set-up; those are the
peer's initial credits. Sending a frame spends one credit of its class. A receiver that frees
a slot (the application took the message, or the frame needed no application) reposts it and
*owes* the credit back; owed credits ride on the header of every frame it sends.

When there is no traffic to carry them, a CREDIT frame does: as soon as the peer is known to
be out of data credits, or the owed credits reach ``threshold``. CREDIT frames spend control
credits, which only come back piggybacked (a CREDIT frame's slot never triggers another CREDIT
frame), so credit frames cannot ping-pong. They cannot deadlock either: control credits are
spent only to grant data credits, and a peer that uses those data credits returns the control
credits on the very frames it sends.

:class:`CreditWindow` is pure bookkeeping (sans-I/O); the endpoint calls it on every send,
receive and release, and it raises typed errors on overrun or over-grant.
"""

from __future__ import annotations

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = ["CreditWindow"]


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
        for name, v in (("local_data_slots", local_data_slots),
                        ("local_ctrl_slots", local_ctrl_slots),
                        ("peer_data_slots", peer_data_slots), ("peer_ctrl_slots", peer_ctrl_slots)):
            if v < 1:
                raise LocalProtocolError(f"{name} must be at least 1, not {v}")
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

    def credit_frame_needed(self) -> bool:
        """Whether a CREDIT frame should go now (and can: a control credit is available)."""
        return self.owed_data > 0 and self.ctrl_credits > 0 and (
            self.peer_data_credits == 0 or self.owed_data >= self.threshold)

    def send_credit(self) -> tuple[int, int]:
        """Spend a control credit on a CREDIT frame; return the credits it carries."""
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

    def received(self, *, control: bool, credits: int, ctrl_credits: int) -> None:
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

    def release(self, *, control: bool) -> None:
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
