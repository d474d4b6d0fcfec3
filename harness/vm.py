"""A small QEMU VM that runs one command on this host's own files, under another kernel.

``python -m harness run`` uses it where the host kernel cannot do RDMA: Debian's kernel (which has
``rdma_rxe``) boots under software emulation (or KVM where allowed), the host's root file system
is shared read-only over 9p and the current directory read-write, so the project's venv and
tests run unchanged. The boot is kept short on purpose (measured in the README):

* the kernel boots through its PVH entry from the uncompressed ``vmlinux``, extracted once from
  ``/boot/vmlinuz-*`` and cached: no BIOS real-mode stage, no decompression under emulation;
* the initramfs (busybox, the virtio/9p modules, :data:`INIT`) is built once per kernel and
  cached; its init mounts what a command needs and nothing else: no udev, no systemd, no probe
  of devices that are not there (``-nodefaults``: no disk, CD, network or display);
* both 9p mounts use the guest's page cache (``cache=loose``: nothing else writes to these
  files while the VM runs), so Python's imports do not cross into QEMU for every ``stat``;
* the emulated CPU is :data:`TCG_CPU`, and the guest kernel runs with ``mitigations=off``.

The command's output comes back on a virtio serial port, its exit status on a second one; the
kernel's console goes to a log that is shown when the guest fails to start.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import lzma
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aiordma._verbs.load import cache_dir

__all__ = ["INITRAMFS_MODULES", "Kernel", "Prepared", "find_kernels", "prepare", "qemu_command"]

#: Modules the initramfs loads (with what they depend on): 9p over virtio, the serial ports,
#: overlayfs.
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "virtio_console", "overlay")

#: The CPU emulated without KVM: the smallest x86-64-v2 model (numpy 2 needs SSE4.2). Measured
#: in the VM against ``max``: rxe WRITE bandwidth 29-43 MB/s against 15-17 MB/s, a Python loop
#: ~15% faster (ib_write_bw 1 MiB and a Python/numpy mix, 3 boots each).
TCG_CPU = "Nehalem"

OUT_PORT = "aiordma.out"     # the command's stdout and stderr
STATUS_PORT = "aiordma.ret"  # its exit status, as text

#: The guest's PID 1 (busybox sh). The kernel hands it the ``aiordma_*`` parameters of its
#: command line as environment variables. It runs ``run.sh`` from the run directory in a chroot
#: into the host's root, then powers off. Exit statuses of its own: 98 (set-up failed).
INIT = r"""#!/bin/sh
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
log() { echo "<3>[aiordma-vm] $*" > /dev/kmsg; }
for m in $(cat /modules/order); do insmod "/modules/$m" || log "insmod $m failed"; done
port() {  # the /dev node of the virtio serial port named $1
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = "$1" ] && { echo "/dev/${p##*/}"; return 0; }
    done
    return 1
}
i=0
until out=$(port aiordma.out) && ret=$(port aiordma.ret) && [ -e "$out" ] && [ -e "$ret" ]; do
    i=$((i + 1)); [ $i -gt 200 ] && { log "no virtio serial ports"; poweroff -f; }
    sleep 0.05
done
exec > "$out" 2>&1 < /dev/null
finish() { echo "$1" > "$ret"; sync; poweroff -f; }
fail() { echo "[aiordma-vm] guest set-up failed: $*"; finish 98; }
R=/newroot
o=trans=virtio,version=9p2000.L,msize=512000,access=any
mount -t 9p -o "ro,cache=loose,$o" hostroot $R || fail "mounting the host's root"
mount -t proc proc $R/proc && mount -t sysfs sys $R/sys && mount -t devtmpfs dev $R/dev \
    || fail "mounting proc, sys, dev"
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
for d in /dev/shm /run; do mount -t tmpfs tmpfs "$R$d" || fail "tmpfs on $d"; done
# /tmp and /var/tmp: the host's files show (a project or cache may live there), writes stay here.
mkdir /ovl && mount -t tmpfs tmpfs /ovl
for d in /tmp /var/tmp; do
    mkdir -p "/ovl$d/u" "/ovl$d/w"
    mount -t overlay overlay -o "xino=off,lowerdir=$R$d,upperdir=/ovl$d/u,workdir=/ovl$d/w" "$R$d" \
        || fail "overlay on $d"
done
mount -t 9p -o "cache=loose,$o" rwdir "$R$aiordma_rwdir" || fail "mounting $aiordma_rwdir"
mkdir $R/run/aiordma-vm && mount -t 9p -o "ro,$o" rundir $R/run/aiordma-vm || fail "mounting the run directory"
echo /bin/modprobe-host > /proc/sys/kernel/modprobe  # modules the kernel asks for come from $R
ip link set lo up
hostname aiordma-vm  # launchers (Open MPI's mpirun) refuse the kernel's "(none)"
# The command's output goes through a pipe and cat: written straight to the virtio serial port,
# any single write past 32 KiB lost the rest (a Python program's large print among them).
# Once the command is done, cat gets at most 2 s to pass on the rest: a process it left in the
# background may hold the pipe open, and must not keep the VM up (it did not before the pipe).
# The init sleeps until the command ends, on a read of a FIFO, rather than looking every 50 ms:
# under emulation those looks cost an idle guest a tenth of a host CPU. Opened read-write, the
# FIFO never blocks the open nor gives an end of file; the read ends with the command's line,
# or early with a signal (the init is PID 1: every orphan's exit is its SIGCHLD), and then the
# status file says whether to wait again. Last, an open releases a writer still blocked in its
# open (the status came first, the read never saw its line).
mkfifo /ovl/done || fail "mkfifo"
( { chroot $R /bin/sh /run/aiordma-vm/run.sh; echo $? > /ovl/status; echo > /ovl/done; } 2>&1 \
    | cat ) &
relay=$!
until [ -s /ovl/status ]; do read -r _ <> /ovl/done || sleep 0.05; done
exec 3<> /ovl/done
i=0
while kill -0 $relay 2>/dev/null && [ $i -lt 40 ]; do sleep 0.05; i=$((i + 1)); done
finish "$(cat /ovl/status)"
"""


@dataclass(frozen=True, slots=True)
class Kernel:
    image: str    # /boot/vmlinuz-RELEASE
    release: str

    @property
    def modules(self) -> str:
        return f"/lib/modules/{self.release}"


@dataclass(frozen=True, slots=True)
class Prepared:
    kernel: Kernel
    boot_image: str  # the PVH vmlinux, or the compressed image where there is no PVH entry
    initramfs: str


def find_kernels(module: str) -> list[Kernel]:
    """Installed kernels (newest first) whose module tree has ``module``."""
    env = os.environ.get("AIORDMA_VM_KERNEL")
    images = [env] if env else sorted(glob.glob("/boot/vmlinuz-*"), reverse=True)
    found = []
    for image in images:
        release = os.path.basename(image)[len("vmlinuz-"):]
        kernel = Kernel(image, release)
        if _has_module(kernel, module):
            found.append(kernel)
    return found


def _has_module(kernel: Kernel, module: str) -> bool:
    """Whether the kernel's module index (``modules.dep``) lists ``module``."""
    try:
        with open(f"{kernel.modules}/modules.dep") as f:
            index = f.read()
    except OSError:
        return False
    return any(line.split(":", 1)[0].rsplit("/", 1)[-1].split(".ko")[0] == module
               for line in index.splitlines())


def _key(kernel: Kernel, busybox: str) -> str:
    h = hashlib.sha256(INIT.encode())
    h.update(repr(INITRAMFS_MODULES).encode())
    for path in (kernel.image, busybox, f"{kernel.modules}/modules.dep"):
        st = os.stat(path)
        h.update(f"{path} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def prepare(kernel: Kernel, *, busybox: str = "/bin/busybox") -> Prepared:
    """The boot image and initramfs for ``kernel``, built once and kept in the cache."""
    where = cache_dir() / "vm" / f"{kernel.release}-{_key(kernel, busybox)}"
    initramfs, vmlinux = where / "initramfs.cpio", where / "vmlinux"
    if not initramfs.exists():
        # Images built by an earlier INIT go once they are a day old: another checkout (with
        # another INIT) may be booting from its own right now.
        day_ago = time.time() - 86400
        for stale in where.parent.glob(f"{kernel.release}-*"):
            with contextlib.suppress(OSError):
                if stale.stat().st_mtime < day_ago:
                    shutil.rmtree(stale, ignore_errors=True)
        where.mkdir(parents=True, exist_ok=True)
        _write_atomic(initramfs, _initramfs(kernel, busybox))
        elf = _extract_vmlinux(kernel.image)
        if elf is not None and _has_pvh_entry(elf):
            _write_atomic(vmlinux, elf)
    boot = str(vmlinux) if vmlinux.exists() else kernel.image
    return Prepared(kernel, boot, str(initramfs))


def qemu_command(prep: Prepared, *, run_dir: str, rwdir: str, out_path: str,
                 status_path: str, console_log: str, memory: str = "2G", cpus: int = 2,
                 kvm: bool = False, nic: list[str] | None = None) -> list[str]:
    """The QEMU command line that boots ``prep`` and runs ``run_dir/run.sh`` in the guest (the
    directory is shared read-only as ``/run/aiordma-vm``); ``rwdir`` is shared read-write at
    the same path as on the host. ``nic``: QEMU arguments of a network card (the two-VM
    pair's link, :mod:`.vm_pair`); without it the VM has none."""
    cmdline = ["console=ttyS0", "quiet", "panic=-1", "mitigations=off", "rdinit=/init",
               f"aiordma_rwdir={rwdir}"]
    return [
        "qemu-system-x86_64", "-nodefaults", "-no-user-config", "-no-reboot",
        "-machine", "pc", "-cpu", "host" if kvm else TCG_CPU,
        "-accel", "kvm" if kvm else "tcg",
        "-m", memory, "-smp", str(cpus),
        "-display", "none", "-vga", "none", *(nic or ["-net", "none"]),
        "-serial", f"file:{console_log}",
        "-kernel", prep.boot_image, "-initrd", prep.initramfs, "-append", " ".join(cmdline),
        "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        "-fsdev", f"local,id=rwdir,path={rwdir},security_model=none,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=rwdir,mount_tag=rwdir",
        "-fsdev", f"local,id=rundir,path={run_dir},security_model=none,readonly=on",
        "-device", "virtio-9p-pci,fsdev=rundir,mount_tag=rundir",
        "-device", "virtio-serial-pci",
        "-chardev", f"file,id=out,path={out_path}",
        "-device", f"virtserialport,chardev=out,name={OUT_PORT}",
        "-chardev", f"file,id=ret,path={status_path}",
        "-device", f"virtserialport,chardev=ret,name={STATUS_PORT}",
    ]


# -- building the pieces -----------------------------------------------------------------------

def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _extract_vmlinux(image: str) -> bytes | None:
    """The ELF kernel inside a bzImage compressed with xz (Debian's), or None."""
    with open(image, "rb") as f:
        data = f.read()
    start = data.find(b"\xfd7zXZ\x00")
    if start < 0:
        return None
    try:
        elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:])
    except lzma.LZMAError:
        return None
    return elf if elf[:4] == b"\x7fELF" else None


def _has_pvh_entry(elf: bytes) -> bool:
    """Whether the ELF carries Xen's PHYS32_ENTRY note (type 18), QEMU's PVH boot entry."""
    return _find_note(elf, b"Xen\x00", 18)


def _find_note(elf: bytes, name: bytes, kind: int) -> bool:
    if elf[4] != 2:  # 64-bit only
        return False
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", elf, phoff + i * phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        pos, end = p_offset, p_offset + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            nm = elf[pos + 12: pos + 12 + namesz]
            if nm == name and ntype == kind:
                return True
            pos += 12 + ((namesz + 3) & ~3) + ((descsz + 3) & ~3)
    return False


def _module_files(kernel: Kernel) -> list[str]:
    """The ``.ko`` files of :data:`INITRAMFS_MODULES` and their dependencies, in load order."""
    files: list[str] = []
    for mod in INITRAMFS_MODULES:
        out = subprocess.run(["modprobe", "-S", kernel.release, "--show-depends", mod],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and parts[1] not in files:
                files.append(parts[1])
    return files


def _initramfs(kernel: Kernel, busybox: str) -> bytes:
    cpio = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "newroot", "modules"):
        cpio.add(d, stat.S_IFDIR | 0o755)
    cpio.add("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))
    cpio.add("dev/null", stat.S_IFCHR | 0o666, rdev=(1, 3))
    cpio.add("dev/kmsg", stat.S_IFCHR | 0o644, rdev=(1, 11))
    cpio.add("bin/busybox", stat.S_IFREG | 0o755, Path(busybox).read_bytes())
    for applet in ("sh", "mount", "insmod", "mkdir", "chroot", "poweroff", "sync", "cat",
                   "sleep", "ip", "mkfifo"):
        cpio.add(f"bin/{applet}", stat.S_IFLNK | 0o777, b"busybox")
    order = []
    for path in _module_files(kernel):
        data = Path(path).read_bytes()
        name = os.path.basename(path)
        if name.endswith(".xz"):
            data, name = lzma.decompress(data), name[:-3]
        elif name.endswith(".zst"):
            data = subprocess.run(["zstd", "-dc", path], capture_output=True, check=True).stdout
            name = name[:-4]
        cpio.add(f"modules/{name}", stat.S_IFREG | 0o644, data)
        order.append(name)
    cpio.add("modules/order", stat.S_IFREG | 0o644, ("\n".join(order) + "\n").encode())
    cpio.add("init", stat.S_IFREG | 0o755, INIT.encode())
    cpio.add("bin/modprobe-host", stat.S_IFREG | 0o755,
             b'#!/bin/sh\nexec chroot /newroot /sbin/modprobe "$@"\n')
    return cpio.finish()


class _Cpio:
    """A ``newc`` cpio archive, the format the kernel unpacks as an initramfs."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._ino = 1

    def add(self, name: str, mode: int, data: bytes = b"", *, rdev: tuple[int, int] = (0, 0)) -> None:
        raw = name.encode() + b"\x00"
        fields = (self._ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(raw), 0)
        self._ino += 1
        self._buf.write(b"070701" + b"".join(b"%08X" % v for v in fields) + raw)
        self._pad()
        self._buf.write(data)
        self._pad()

    def _pad(self) -> None:
        self._buf.write(b"\x00" * (-self._buf.tell() % 4))

    def finish(self) -> bytes:
        self.add("TRAILER!!!", 0)
        return self._buf.getvalue()
