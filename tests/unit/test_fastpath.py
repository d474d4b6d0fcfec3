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
    assert "aiordma/_verbs/_fastpath*.so" in ignored and "protocols/_*_c*.so" in ignored


def test_endpoints_use_the_compiled_message_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set-up compiles the message protocol on every machine (it needs no rdma-core), so it
    must be here; AIORDMA_FASTPATH=0 gives the Python class."""
    import aiordma._verbs.compiled as fast
    from aiordma.protocols import messages

    monkeypatch.delenv("AIORDMA_FASTPATH", raising=False)
    cls = fast.message_protocol()
    assert cls is not messages.MessageProtocol, fast.describe()
    assert cls.__module__ == "aiordma.protocols._messages_c"
    assert "message protocol compiled" in fast.describe()
    monkeypatch.setenv("AIORDMA_FASTPATH", "0")
    assert fast.message_protocol() is messages.MessageProtocol


def test_a_compiled_protocol_of_other_sources_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiordma._verbs.compiled as fast
    from aiordma.protocols import messages

    monkeypatch.delenv("AIORDMA_FASTPATH", raising=False)
    monkeypatch.setattr(fast, "_protocol", None)
    monkeypatch.setattr(fast, "_protocol_why_not", None)
    monkeypatch.setattr(fast, "protocol_source_digest", lambda: "0" * 16)  # messages.py edited
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
