"""The developer harness: where a command gets an RDMA device when this machine has none, and
two hosts joined by a wire. Not installed with aiordma; run from the repository's root as
``python -m harness`` (:mod:`.cli`).

* :mod:`.run`: ``run -- CMD`` here (rxe made where the kernel allows it) or in a small QEMU VM
  (:mod:`.vm` builds its boot image), the boot bounded (:mod:`.boot`);
* :mod:`.pair`: ``run --hosts 2 -- CMD``, two VMs joined by a private link; host 2's command
  agent (:mod:`.host_agent`) and host 1's side of it (:mod:`.remote`: ``exec``, ``rsh``,
  ``kill 2``, ``boot 2``); :mod:`.hostload` shows this machine's load inside the VMs;
* :mod:`.bench`: ``aiordma bench`` across the wire (``bench``) and the allreduce beside Open
  MPI there (``harness.bench.collective_wire``).

It depends on the installed package (``aiordma``); nothing installed depends on it. This file
imports nothing: host 2's agent (``python -m harness.host_agent``) must start fast.
"""
