"""No ``assert`` guards a condition that input can reach: ``python -O`` drops asserts, so a
check of an argument, of a peer's bytes or of a device's answer must be a typed error. The
asserts left in the library (and in the developer harness) are listed here, each with why nothing a caller, a peer or a
device does can reach it (they narrow types for mypy, or restate what the code just
established); a new one fails this test until it is judged and listed, or replaced."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

INVARIANTS: dict[tuple[str, str], str] = {
    ("aiordma/_endpoint/connect.py", "self.qp is not None"):
        "_Resources.__init__ sets qp or raises; the methods run on a constructed one",
    ("aiordma/_endpoint/connect.py", "self.qp and self.slots"):
        "the same: both are set, or __init__ raised",
    ("aiordma/_endpoint/listener.py", "task is not None"):
        "asyncio.current_task() inside a coroutine that asyncio.start_server runs as a task",
    ("aiordma/_endpoint/listener.py", "dev is not None"):
        "_transport_for() returns a device for an RDMA Hello, or raises (a Reject went out)",
    ("aiordma/_tcp/channel.py", "control is not None and self._ready is not None"):
        "_before_ready() runs only while _control is set, which only a server's channel has, "
        "made with its _ready future",
    ("aiordma/_endpoint/connect.py", "isinstance(ev, hs.Event)"):
        "next_event() returns an Event or NEED_DATA, and NEED_DATA was just excluded",
    ("aiordma/_device/watch.py", "self._uevents is not None"):
        "the reader callback is registered only once the uevent socket exists",
    ("aiordma/_endpoint/endpoint.py", "isinstance(item, msgs.Incoming)"):
        "the protocol said the head is UNREAD, which only an Incoming is",
    ("aiordma/_endpoint/onesided.py", "value is not None"):
        "run() returns the old value whenever it is given a scratch slot (atomics)",
    ("aiordma/testing.py", "msg.taken is not None"):
        "both callers check msg.taken before waiting on it",
    ("aiordma/bench/peer.py", "isinstance(ep, aiordma.Endpoint)"):
        "the bench peer is the handler of its own listener, which passes Endpoints",
    ("aiordma/bench/peers.py", "mpirun is not None"):
        "a missing mpirun raised PeersNotInstalled just above",
    ("services/collectives/_data_ops.py", "arr is not None"):
        "broadcast's root always has its array: as_input() returned it or raised",
    ("services/collectives/_data_ops.py", "got is not None"):
        "_direct.scatter returns the received array on every rank but the root",
    ("services/collectives/_direct.py", "headers is not None and sizes is not None"):
        "scatter's root passes its headers and sizes; only the others pass None",
    ("services/collectives/_core.py", "number is not None"):
        "collectives (channel 0) number themselves just above; point-to-point callers pass "
        "their number",
    ("services/collectives/_core.py", "plane is not None"):
        "_links_for() just raised GroupError for a group without a plane",
    ("services/collectives/_core.py", "task is not None"):
        "asyncio.current_task() inside a coroutine: operations are awaited in tasks",
    ("services/collectives/_quick.py", "fast is not None"):
        "GroupCore makes QuickCalls only for a compiled step runner, which only the compiled "
        "module makes",
    ("services/collectives/_quick.py", "not isinstance(started, bool)"):
        "settle's callers pass what a QuickCore call returned, neither None nor True, and "
        "False returned just above",
    ("services/collectives/_window.py", "plane is not None"):
        "_links_for() just raised GroupError for a group without a plane",
    ("services/collectives/_window.py", "region is not None"):
        "a work buffer is registered after work() on RDMA links, and window() refused a "
        "group whose links are TCP",
    ("services/collectives/_window.py", "task is not None"):
        "asyncio.current_task() inside a coroutine: wait_signal is awaited in a task",
    ("services/collectives/_fabric.py", "failure is not None"):
        "echo() is called only once the group has failed (its caller checked failure)",
    ("services/collectives/_links.py", "router is not None"):
        "_take() runs only in readers, which start() starts after setting the router",
    ("services/collectives/_links.py", "d.data is not None"):
        "get() returns only Inline or Piece deliveries (anything else raised), which carry "
        "their bytes",
    ("services/collectives/_reduce_ops.py", "dst is not None"):
        "the algorithms return values only on the root, where dst was set (out or array)",
    ("services/collectives/launch.py", "pipe is not None"):
        "run() starts every rank with stdout=PIPE and stderr=PIPE",
    ("services/collectives/_mesh.py", "self._token is not None"):
        "the listener whose handler this is starts after form() made the token's future",
    ("services/collectives/_links.py", "region is not None and self.remote is not None"):
        "a piece is written only on an RDMA link (over TCP inline_max is the piece size, so "
        "every piece is inline), where the work buffers are registered and the peer's slots "
        "were checked at formation",
    ("services/collectives/_rounds.py", "nbytes is not None"):
        "the root passes nbytes, and every other rank has just read it from its parent",
    ("aiordma/bench/process.py", "proc.stdout is not None"):
        "the process was started with stdout=PIPE",
    ("harness/run.py", "proc.stdout is not None"):
        "the process was started with stdout=PIPE",
    ("harness/run.py", "qemu is not None"):
        "a missing QEMU returned the reason just above",
    ("protocols/handshake/__init__.py", "self._secret is not None and self._hello is not None"):
        "the state table allows Proof/authenticated Accept only after a Hello with a secret",
    ("protocols/handshake/__init__.py", "secret is not None and self._hello is not None"):
        "a Proof is accepted only in CHALLENGE_SENT: a server with a secret that got a Hello",
    ("protocols/handshake/__init__.py", "self._hello is not None"):
        "an Accept with a secret is accepted only in PROOF_SENT, after this side's Hello",
    ("protocols/messages/_protocol.py", "isinstance(item, Incoming)"):
        "the inbox holds bytearrays, Immediates and Incomings, and the first two were just "
        "excluded",
    ("services/collectives/_links.py", "isinstance(ep, Endpoint) and self.remote is not None"):
        "_write() is called only for written pieces, which go only on RDMA links (see the "
        "assert in put() above it)",
}


def library_asserts() -> Counter[tuple[str, str]]:
    found: Counter[tuple[str, str]] = Counter()
    for top in ("aiordma", "protocols", "services", "harness"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assert):
                    found[(rel, ast.unparse(node.test))] += 1
    return found


def test_every_assert_left_is_an_invariant_no_input_reaches() -> None:
    unjudged = sorted(set(library_asserts()) - set(INVARIANTS))
    assert not unjudged, f"asserts no one has judged (a typed error, or list it): {unjudged}"


def test_the_list_has_no_stale_entries() -> None:
    assert not set(INVARIANTS) - set(library_asserts())
