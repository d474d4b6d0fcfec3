"""The pieces :mod:`harness.vm` builds for its VM, checked without booting one: the cpio
archive the kernel unpacks, the ELF note that selects the PVH entry, the guest's init script
and the QEMU command line (booting is what every device test run does); and, where QEMU and a
kernel with rxe are installed, one boot that checks what the guest's output port loses."""

from __future__ import annotations

import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness import vm

ROOT = Path(__file__).resolve().parents[2]


def read_newc(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """name -> (mode, body, rdev), by the format's definition (an independent reader)."""
    out: dict[str, tuple[int, bytes, tuple[int, int]]] = {}
    pos = 0
    while True:
        assert data[pos:pos + 6] == b"070701", pos
        f = [int(data[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rmaj, rmin, namesize = f[1], f[6], f[9], f[10], f[11]
        name_at = pos + 110
        name = data[name_at: name_at + namesize - 1].decode()
        assert data[name_at + namesize - 1] == 0
        body_at = (name_at + namesize + 3) & ~3
        body = data[body_at: body_at + size]
        pos = (body_at + size + 3) & ~3
        if name == "TRAILER!!!":
            assert pos == len(data)
            return out
        out[name] = (mode, body, (rmaj, rmin))


def test_the_cpio_writer_writes_what_a_newc_reader_reads() -> None:
    cpio = vm._Cpio()
    cpio.add("bin", stat.S_IFDIR | 0o755)
    for n in range(6):  # every padding case of name and body
        cpio.add(f"bin/f{'x' * n}", stat.S_IFREG | 0o644, bytes(range(n)) * 3)
    cpio.add("bin/sh", stat.S_IFLNK | 0o777, b"busybox")
    cpio.add("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))
    entries = read_newc(cpio.finish())
    assert entries["bin"][0] == stat.S_IFDIR | 0o755
    for n in range(6):
        assert entries[f"bin/f{'x' * n}"][1] == bytes(range(n)) * 3
    assert entries["bin/sh"] == (stat.S_IFLNK | 0o777, b"busybox", (0, 0))
    assert entries["dev/console"] == (stat.S_IFCHR | 0o600, b"", (5, 1))


@pytest.mark.skipif(shutil.which("cpio") is None and shutil.which("busybox") is None,
                    reason="no cpio tool here to cross-check with")
def test_a_cpio_tool_lists_the_archive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cpio = vm._Cpio()
    cpio.add("a", stat.S_IFDIR | 0o755)
    cpio.add("a/b", stat.S_IFREG | 0o644, b"hello")
    path = tmp_path / "x.cpio"
    path.write_bytes(cpio.finish())
    tool = ["cpio"] if shutil.which("cpio") else ["busybox", "cpio"]
    listed = subprocess.run([*tool, "-t"], stdin=path.open("rb"), capture_output=True,
                            text=True, check=True).stdout.split()
    assert listed == ["a", "a/b"]


def elf_with_notes(notes: list[tuple[bytes, int, bytes]]) -> bytes:
    """A minimal 64-bit ELF with one PT_NOTE segment holding ``notes``."""
    body = b""
    for name, kind, desc in notes:
        body += struct.pack("<III", len(name), len(desc), kind)
        body += name + b"\x00" * (-len(name) % 4) + desc + b"\x00" * (-len(desc) % 4)
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x20, 64)       # e_phoff
    struct.pack_into("<HH", header, 0x36, 56, 1)   # e_phentsize, e_phnum
    phdr = struct.pack("<IIQQQQQQ", 4, 0, 64 + 56, 0, 0, len(body), len(body), 4)
    return bytes(header) + phdr + body


def test_the_pvh_entry_note_is_found_only_where_it_is() -> None:
    xen = b"Xen\x00"
    assert vm._has_pvh_entry(elf_with_notes([(xen, 6, b"linux\x00"), (xen, 18, b"\x50" * 8)]))
    assert not vm._has_pvh_entry(elf_with_notes([(xen, 6, b"linux\x00"), (xen, 17, b"\x00" * 8)]))
    assert not vm._has_pvh_entry(elf_with_notes([(b"GNU\x00", 18, b"\x00" * 8)]))


def test_the_guest_init_is_valid_shell_and_opens_the_ports_qemu_gets() -> None:
    sh = shutil.which("sh")
    assert sh is not None
    subprocess.run([sh, "-n"], input=vm.INIT, text=True, check=True)
    assert f"port {vm.OUT_PORT})" in vm.INIT and f"port {vm.STATUS_PORT})" in vm.INIT


def test_kernels_are_found_by_their_module_index(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    kernel = vm.Kernel("/boot/vmlinuz-9.9", "9.9")
    monkeypatch.setattr(vm.Kernel, "modules", property(lambda self: str(tmp_path)))
    assert not vm._has_module(kernel, "rdma_rxe")  # no index at all
    (tmp_path / "modules.dep").write_text(
        "kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz: kernel/x/ib_core.ko\n"
        "kernel/fs/9p/9p.ko:\n")
    assert vm._has_module(kernel, "rdma_rxe") and vm._has_module(kernel, "9p")
    assert not vm._has_module(kernel, "rdma") and not vm._has_module(kernel, "ib_core")


def test_the_qemu_command_shares_the_root_read_only_and_the_directory_read_write() -> None:
    prep = vm.Prepared(vm.Kernel("/boot/vmlinuz-x", "x"), "/c/vmlinux", "/c/initramfs.cpio")
    args = vm.qemu_command(prep, run_dir="/c/run-1", rwdir="/work/p", out_path="/proc/self/fd/1",
                           status_path="/c/run-1/status", console_log="/c/run-1/console.log")
    joined = " ".join(args)
    assert "local,id=hostroot,path=/,security_model=none,readonly=on" in joined
    assert "local,id=rwdir,path=/work/p,security_model=none,multidevs=remap" in joined
    assert "path=/c/run-1,security_model=none,readonly=on" in joined
    assert args[args.index("-kernel") + 1] == "/c/vmlinux"
    assert "aiordma_rwdir=/work/p" in args[args.index("-append") + 1]
    assert "-nodefaults" in args and "-accel" in args and args[args.index("-accel") + 1] == "tcg"
    kvm = vm.qemu_command(prep, run_dir="/r", rwdir="/w", out_path="o", status_path="s",
                          console_log="c", kvm=True)
    assert kvm[kvm.index("-accel") + 1] == "kvm"


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None or not vm.find_kernels("rdma_rxe"),
                    reason="no QEMU or no kernel with rdma_rxe to boot")
def test_a_large_single_write_in_the_guest_reaches_the_host_whole() -> None:
    """A write to a virtio serial port takes at most 32 KiB; Python's stdout did not retry the
    short write and lost the rest (a bench table was cut in half). The guest's output now goes
    through a pipe and cat, which retries."""
    prog = ("import os, sys; n = os.write(1, b'x' * 100000); sys.stdout.write('y' * 100000); "
            "sys.stdout.flush(); print(f' wrote {n}', file=sys.stderr); sys.exit(3)")
    # A process the command leaves in the background must not keep the VM up (it holds the
    # pipe the output now goes through): with `sleep 600` behind, the run ends well within
    # the subprocess timeout (a hang guard, not a timing).
    cmd = f'sleep 600 & exec {sys.executable} -c "{prog}"'
    out = subprocess.run([sys.executable, "-m", "harness", "run", "--vm", "--",
                          "sh", "-c", cmd], capture_output=True, text=True,
                         timeout=240, check=False, cwd=ROOT)
    assert out.returncode == 3, out.stderr[-2000:]  # the command's own exit status
    assert out.stdout.count("x") == 100000 and out.stdout.count("y") == 100000, (
        len(out.stdout), out.stderr[-2000:])
