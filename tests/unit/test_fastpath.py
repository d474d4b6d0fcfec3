"""The compiled fast path's device-free parts: the switch between paths, the completion record
handlers receive, and how set-up builds and caches the module. No device; the verbs calls
themselves are tested in tests/rxe/test_fastpath.py (both paths, differentially)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from .import_graph import ROOT


def test_aiordma_fastpath_0_selects_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiordma._verbs.compiled import describe, fastpath
    from aiordma.lowlevel import verbs_path

    monkeypatch.setenv("AIORDMA_FASTPATH", "0")
    assert fastpath() is None
    assert describe() == verbs_path() == "python (AIORDMA_FASTPATH=0)"


def _module() -> object:
    from aiordma._verbs.compiled import describe, fastpath

    mod = fastpath()
    if mod is None:
        pytest.skip(f"the compiled fast path is not here: {describe()}")
    return mod


def test_the_path_in_use_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiordma._verbs.compiled import describe

    monkeypatch.delenv("AIORDMA_FASTPATH", raising=False)
    _module()
    assert describe().startswith("compiled (_fastpath.")


def test_a_completion_carries_the_fields_handlers_read() -> None:
    mod = _module()
    c = mod.completion(wr_id=(7 << 32) | 5, status=12, opcode=128, byte_len=4096,  # type: ignore[attr-defined]
                       vendor_err=0x81, qp_num=0x11)
    assert (c.wr_id, c.status, c.opcode, c.byte_len, c.vendor_err, c.qp_num) == (
        (7 << 32) | 5, 12, 128, 4096, 0x81, 0x11)
    assert "byte_len=4096" in repr(c)
    with pytest.raises(AttributeError):
        c.status = 0  # read-only, like pyverbs' WC from a handler's point of view


def _build_script() -> object:
    spec = importlib.util.spec_from_file_location("build_fastpath",
                                                  ROOT / "scripts" / "build_fastpath.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_fastpath"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_build_is_keyed_by_the_prefix_it_compiles_against(tmp_path: Path) -> None:
    pytest.importorskip("Cython")
    build = _build_script()
    (tmp_path / ".complete").write_text("rdma-core 59.0: a")
    first = build.verbs_key(tmp_path)  # type: ignore[attr-defined]
    assert build.verbs_key(tmp_path) == first  # type: ignore[attr-defined]
    (tmp_path / ".complete").write_text("rdma-core 59.0: b")
    assert build.verbs_key(tmp_path) != first  # type: ignore[attr-defined]
    assert build.protocol_key() not in (first, build.verbs_key(tmp_path))  # type: ignore[attr-defined]


def test_a_prefix_without_declarations_is_refused(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    build = _build_script()
    monkeypatch.setattr(sys, "argv", ["build_fastpath.py", str(tmp_path), str(tmp_path)])
    assert build.main() == 1  # type: ignore[attr-defined]
    assert not (tmp_path / "fastpath").exists()


def test_setup_builds_it_and_git_ignores_the_result() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'scripts/build_fastpath.py" "$prefix" "$cache"' in setup
    assert 'scripts/build_fastpath.py" - "$cache"' in setup  # the protocol, without a prefix
    assert 'cp "$src"/pyverbs/*.pxd' in setup  # what it compiles against
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "aiordma/_verbs/_fastpath*.so" in ignored and "protocols/messages/_*_c*.so" in ignored


def test_endpoints_use_the_compiled_message_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set-up compiles the message protocol on every machine (it needs no rdma-core), so it
    must be here; AIORDMA_FASTPATH=0 gives the Python class."""
    import aiordma._verbs.compiled as fast
    from aiordma.protocols import messages

    monkeypatch.delenv("AIORDMA_FASTPATH", raising=False)
    cls = fast.message_protocol()
    assert cls is not messages.MessageProtocol, fast.describe()
    assert cls.__module__ == "aiordma.protocols.messages._protocol_c"
    assert "message protocol compiled" in fast.describe()
    monkeypatch.setenv("AIORDMA_FASTPATH", "0")
    assert fast.message_protocol() is messages.MessageProtocol


def test_a_compiled_protocol_of_other_sources_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiordma._verbs.compiled as fast
    from aiordma.protocols import messages

    monkeypatch.delenv("AIORDMA_FASTPATH", raising=False)
    monkeypatch.setattr(fast, "_protocol", None)
    monkeypatch.setattr(fast, "_protocol_why_not", None)
    monkeypatch.setattr(fast, "protocol_source_digest", lambda: "0" * 16)  # _protocol.py edited
    assert fast.message_protocol() is messages.MessageProtocol
    assert "built from other sources" in fast.describe()


def test_without_any_pyverbs_the_path_is_named_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aiordma devices --json`` and the bench call describe(): no pyverbs must not crash it."""
    import aiordma._verbs.compiled as fast
    import aiordma._verbs.load as native
    from aiordma import DeviceError

    def missing() -> None:
        raise DeviceError("pyverbs is not importable: (test)")

    monkeypatch.delenv("AIORDMA_FASTPATH", raising=False)
    monkeypatch.setattr(fast, "_module", None)
    monkeypatch.setattr(fast, "_why_not", None)
    monkeypatch.setattr(native, "require_pyverbs", missing)
    assert fast.describe() == "none: pyverbs is not importable: (test)"


def test_the_verbs_module_links_the_prefix_libibverbs() -> None:
    """Its ibv_* symbols must come from the libibverbs it was compiled against: linked with
    the library named before the source, --as-needed dropped it, the symbols were bound to
    whatever libibverbs the process had, and closing a CQ crashed."""
    import shutil
    import subprocess

    mod = _module()
    readelf = shutil.which("readelf")  # binutils: there wherever gcc built the module
    assert readelf is not None
    dynamic = subprocess.run([readelf, "-d", str(mod.__file__)], capture_output=True, text=True,  # type: ignore[attr-defined]
                             check=True).stdout
    assert "[libibverbs.so.1]" in dynamic and "rdma-core" in dynamic  # NEEDED, and its RUNPATH


def test_both_routes_know_the_opcode_of_a_write_with_immediate_data() -> None:
    from aiordma._verbs import pydrivers
    from aiordma._verbs.enums import value

    assert pydrivers._RECV_RDMA_WITH_IMM == value("WC_RECV_RDMA_WITH_IMM")
    mod = _module()
    assert mod.RECV_RDMA_WITH_IMM == value("WC_RECV_RDMA_WITH_IMM")  # type: ignore[attr-defined]


def test_the_python_route_hands_an_immediate_to_the_protocol() -> None:
    """A receive completion of a WRITE with immediate data reaches ``on_immediate`` with the
    value in host order (the completion carries it as sent: network order); a plain receive
    still reaches ``on_completion``; a side that does not accept them fails."""
    import socket
    from collections import deque
    from types import SimpleNamespace

    from aiordma._verbs.pydrivers import PyMessageRoute
    from aiordma.protocols import messages as m
    from aiordma.protocols.errors import RemoteProtocolError

    from .test_protocol_messages import data_frame

    def route_for(immediates: bool) -> tuple[m.MessageProtocol, PyMessageRoute, list]:
        proto = m.MessageProtocol(
            send_region=memoryview(bytearray(4 * 128)), recv_region=memoryview(bytearray(
                7 * 128)), slot_size=128, send_slots=4, data_slots=4, ctrl_slots=3,
            peer_slot_size=128, peer_data_slots=4, peer_ctrl_slots=3, peer_max_message=1 << 20,
            max_message=1 << 20, recv_budget=1 << 16)
        proto.immediates = immediates
        proto.take_actions()
        failures: list = []
        return proto, PyMessageRoute(proto, lambda acts: None, deque(), failures.append,
                                     lambda rest: None), failures

    def wc(slot: int, nbytes: int, opcode: int, imm: int = 0) -> SimpleNamespace:
        return SimpleNamespace(wr_id=(7 << 32) | slot, status=0, opcode=opcode,
                               byte_len=nbytes, imm_data=socket.htonl(imm))

    proto, route, failures = route_for(True)
    route(wc(0, 5000, 129, 0xDEAD_BEEF))
    frame = data_frame(b"hi")
    proto._recv[128:128 + len(frame)] = frame
    route(wc(1, len(frame), 128))
    first, second = proto.pop(), proto.pop()
    assert type(first) is m.Immediate and (first.value, first.nbytes) == (0xDEAD_BEEF, 5000)
    assert second == b"hi" and not failures
    proto, route, failures = route_for(False)
    route(wc(0, 10, 129, 1))
    assert len(failures) == 1 and isinstance(failures[0], RemoteProtocolError)


def test_two_builds_of_one_key_at_once_both_end_with_the_build(tmp_path: Path) -> None:
    """Two checkouts' set-ups on one machine may build the same sources at once (they did: one
    removed the other's half-built directory and its link step failed). A build that another
    finishes first, while it runs, ends with the other's build in place and its own file."""
    build = _build_script()
    cache, a, b = tmp_path / "cache", tmp_path / "a" / "mod.so", tmp_path / "b" / "mod.so"
    a.parent.mkdir()
    b.parent.mkdir()
    seen: list[list[str]] = []

    def slow(out: Path) -> None:  # the first build: the second starts and ends meanwhile
        (out / "mod.so").write_bytes(b"first")
        seen.append(sorted(p.name for p in out.parent.iterdir()))
        build.cached_build(cache, "x module", "k", fast, [b])  # type: ignore[attr-defined]

    def fast(out: Path) -> None:
        (out / "mod.so").write_bytes(b"second")

    build.cached_build(cache, "x module", "k", slow, [a])  # type: ignore[attr-defined]
    assert a.read_bytes() == b.read_bytes() == b"second"  # (the first to finish is used)
    assert seen and all(".partial-" in name for name in seen[0])
    assert sorted(p.name for p in (cache / "fastpath").iterdir()) == ["x-k"]
