"""tests/restrack.py: reading the kernel's per-process resource lists (no device needed: the
texts are what ``rdma -j resource show KIND`` printed in the VM, kernel 6.1, iproute2 6.1)."""

from __future__ import annotations

import os

import pytest

from tests import restrack

MR = ('[{"ifindex":0,"ifname":"rxe0","mrn":0,"rkey":"0","lkey":"216","mrlen":4096,"pdn":1,'
      '"pid":147,"comm":"python"}]')
PD = ('[{"ifindex":0,"ifname":"rxe0","pdn":0,"local_dma_lkey":"111","users":1,"comm":"ib_core"},'
      '{"ifindex":0,"ifname":"rxe0","pdn":1,"local_dma_lkey":"0","users":1,"ctxn":1,"pid":147,'
      '"comm":"python"},{"ifindex":0,"ifname":"rxe0","pdn":2,"users":1,"ctxn":2,"pid":150,'
      '"comm":"python"}]')
QP_KERNEL_ONLY = ('[{"ifindex":0,"ifname":"rxe0","port":1,"lqpn":1,"type":"GSI","state":"RTS",'
                  '"sq-psn":0,"comm":"ib_core"}]')


def test_objects_are_counted_by_owner_and_the_kernels_own_are_left_out() -> None:
    assert restrack.count_by_pid(MR) == {147: 1}
    assert restrack.count_by_pid(PD) == {147: 1, 150: 1}
    assert restrack.count_by_pid(QP_KERNEL_ONLY) == {}
    assert restrack.count_by_pid("") == {}  # nothing at all


@pytest.mark.parametrize("text", ["rdma: command not found", '{"pid": 1}'])
def test_anything_else_is_an_error_not_zero(text: str) -> None:
    with pytest.raises(restrack.RestrackUnavailable):
        restrack.count_by_pid(text)


def test_every_kind_for_every_pid_from_the_rdma_command(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = tmp_path / "rdma"
    fake.write_text("#!/bin/sh\ncase \"$4\" in\n"
                    f"  mr) echo '{MR}';;\n  pd) echo '{PD}';;\n  qp) echo '{QP_KERNEL_ONLY}';;\n"
                    "  *) echo '[]';;\nesac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert restrack.kernel_counts([147, 999]) == {
        147: {"ctx": 0, "pd": 1, "cq": 0, "qp": 0, "mr": 1},
        999: {"ctx": 0, "pd": 0, "cq": 0, "qp": 0, "mr": 0}}


def test_a_failing_rdma_command_is_an_error(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = tmp_path / "rdma"
    fake.write_text("#!/bin/sh\necho 'error: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(restrack.RestrackUnavailable, match="not permitted"):
        restrack.kernel_counts([1])
