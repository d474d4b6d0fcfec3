"""The command agent of the second VM: host 1 starts processes on host 2 through it.

``python -m harness run --hosts 2`` boots two VMs joined by a private link (:mod:`.pair`).
Host 2 runs only this agent (``python -m harness.host_agent --listen 10.77.0.2:7790``); host
1 runs the command, which reaches host 2 with :class:`harness.remote.RemoteProcess` or
``python -m harness exec 2 -- CMD``. The agent listens on the link's address only, so nothing
outside the two VMs can reach it, and it is stdlib only (nor does ``harness/__init__.py``
import anything), so it starts fast under emulation.

The wire, one TCP connection per process:

* the client sends one JSON line: ``{"argv": [...], "cwd": ..., "env": {...}}`` (``env``
  overrides the agent's environment), ``{"ping": true}`` (answered with exit status 0: the
  agent is up), or ``{"stop": true}`` (sync the file systems and stop the agent, so that host
  2 powers off);
* the agent answers with frames, each ``kind`` (1 byte), ``length`` (4 bytes, big-endian),
  payload: :data:`STDOUT` and :data:`STDERR` carry the process's output as it comes,
  :data:`HEARTBEAT` (empty) is sent every :data:`HEARTBEAT_S` seconds while it runs (so a
  client tells a quiet process from a host that is gone), :data:`EXIT` carries the exit status
  as text (negative: killed by that signal), :data:`FAILED` why it could not start;
* when the client's side of the connection closes (it is done, killed, or its host died and
  the connection reset), the agent kills the process's whole group (SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
from typing import Any

__all__ = ["EXIT", "FAILED", "HEARTBEAT", "HEARTBEAT_S", "PORT", "STDERR", "STDOUT",
           "read_frame", "serve"]

PORT = 7790
STDOUT, STDERR, HEARTBEAT, EXIT, FAILED = b"O", b"E", b"H", b"X", b"F"
HEARTBEAT_S = 1.0
_HEADER = struct.Struct(">cI")
MAX_REQUEST = 1 << 20
#: Seconds a connection gets to send its request line.
REQUEST_WAIT = 30.0


def read_frame(sock: socket.socket) -> tuple[bytes, bytes] | None:
    """The next frame ``(kind, payload)`` from ``sock``, or None at the end of the stream."""
    head = _read_exactly(sock, _HEADER.size)
    if head is None:
        return None
    kind, n = _HEADER.unpack(head)
    payload = _read_exactly(sock, n) if n else b""
    return None if payload is None else (kind, payload)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class _Session:
    """One connection: one process, its output pumped into frames, heartbeats, the exit."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.gone = threading.Event()  # the client's side closed, or a send failed

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        try:
            with self.lock:
                self.sock.sendall(_HEADER.pack(kind, len(payload)) + payload)
        except OSError:
            self.gone.set()

    def pump(self, pipe: Any, kind: bytes) -> None:
        while chunk := os.read(pipe.fileno(), 65536):
            self.send(kind, chunk)
        pipe.close()

    def watch_client(self) -> None:
        """Returns when the client's side is closed (or reset): the process must go."""
        try:
            while self.sock.recv(4096):
                pass
        except OSError:
            pass
        self.gone.set()

    def run(self, req: dict[str, Any]) -> None:
        env = dict(os.environ)
        env.update(req.get("env") or {})
        try:
            proc = subprocess.Popen(req["argv"], cwd=req.get("cwd"), env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.send(FAILED, f"{type(exc).__name__}: {exc}".encode())
            return
        pumps = [threading.Thread(target=self.pump, args=(proc.stdout, STDOUT), daemon=True),
                 threading.Thread(target=self.pump, args=(proc.stderr, STDERR), daemon=True)]
        for t in pumps:
            t.start()
        threading.Thread(target=self.watch_client, daemon=True).start()
        while proc.poll() is None:
            if self.gone.wait(HEARTBEAT_S):
                break
            self.send(HEARTBEAT)
        # Done (or the client is gone): what it left in its group goes too, so that its pipes
        # close and the pumps end.
        _kill_group(proc)
        for t in pumps:
            t.join(5)
        if not self.gone.is_set():
            self.send(EXIT, str(proc.returncode).encode())


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        session = _Session(self.request)
        self.request.settimeout(REQUEST_WAIT)
        try:
            line = self.rfile.readline(MAX_REQUEST)
        except TimeoutError:
            session.send(FAILED, f"no request line within {REQUEST_WAIT:g} s".encode())
            return
        self.request.settimeout(None)  # (a process's session ends when the client closes)
        try:
            req = json.loads(line)
        except ValueError as exc:
            session.send(FAILED, f"bad request: {exc}".encode())
            return
        if not isinstance(req, dict):
            session.send(FAILED, b"bad request: not an object")
            return
        if req.get("ping"):
            session.send(EXIT, b"0")
            return
        if req.get("stop"):
            os.sync()
            session.send(EXIT, b"0")
            threading.Thread(target=self.server.shutdown, daemon=True).start()
            return
        session.run(req)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(host: str, port: int = PORT) -> None:
    """Serve until a stop request (the harness sends one when host 1's command is done)."""
    with _Server((host, port), _Handler) as server:
        print(f"[host-agent] listening on {host}:{server.server_address[1]}", file=sys.stderr,
              flush=True)
        server.serve_forever(poll_interval=0.2)
    print("[host-agent] stopped", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--listen", required=True, metavar="HOST:PORT")
    a = p.parse_args(argv)
    host, _, port = a.listen.rpartition(":")
    serve(host, int(port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
