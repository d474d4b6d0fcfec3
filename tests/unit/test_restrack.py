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
    assert restrack.ids_by_pid(MR, "mr") == {147: {("rxe0", 0)}}
    assert restrack.ids_by_pid(PD, "pd") == {147: {("rxe0", 1)}, 150: {("rxe0", 2)}}
    assert restrack.ids_by_pid(QP_KERNEL_ONLY, "qp") == {}
    assert restrack.ids_by_pid("", "qp") == {}  # nothing at all


@pytest.mark.parametrize("text", ["rdma: command not found", '{"pid": 1}'])
def test_anything_else_is_an_error_not_zero(text: str) -> None:
    with pytest.raises(restrack.RestrackUnavailable):
        restrack.ids_by_pid(text, "qp")


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


def _qps(*numbers: int, pid: int = 147) -> str:
    return "[" + ",".join(f'{{"ifname":"rxe0","lqpn":{n},"type":"RC","pid":{pid},'
                          f'"comm":"python"}}' for n in numbers) + "]"


def _rdma_reading(tmp_path, monkeypatch, listings: list[str]) -> None:  # type: ignore[no-untyped-def]
    """A fake `rdma` whose n-th `resource show qp` prints listings[n] (the last one after)."""
    for i, text in enumerate(listings):
        (tmp_path / f"qp{i}").write_text(text)
    fake = tmp_path / "rdma"
    fake.write_text(f"#!/bin/sh\n[ \"$4\" = qp ] || {{ echo '[]'; exit 0; }}\n"
                    f"n=$(cat {tmp_path}/n 2>/dev/null || echo 0)\n"
                    f"[ $n -lt {len(listings) - 1} ] && echo $((n + 1)) > {tmp_path}/n\n"
                    f"cat {tmp_path}/qp$n\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_a_list_that_skipped_objects_is_read_again(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The first read missed two of the five (another process closed objects mid-dump); the
    # next two agree on all five.
    _rdma_reading(tmp_path, monkeypatch, [_qps(1, 2, 5), _qps(1, 2, 3, 4, 5), _qps(1, 2, 3, 4, 5)])
    assert restrack.kernel_counts([147], ["qp"]) == {147: {"qp": 5}}


def test_reads_that_never_agree_count_every_object_any_showed(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    reads = [_qps(1, 2), _qps(2, 3), _qps(1, 3), _qps(1, 4), _qps(2, 4)]
    _rdma_reading(tmp_path, monkeypatch, reads)
    assert restrack.kernel_counts([147], ["qp"]) == {147: {"qp": 4}}
    assert int((tmp_path / "n").read_text()) == restrack.READS - 1  # READS reads, no more


def test_other_owners_do_not_stop_the_agreement(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Another pid's objects change between reads (it is busy); ours agree at once.
    _rdma_reading(tmp_path, monkeypatch, [
        _qps(1, 2)[:-1] + "," + _qps(7, pid=150)[1:],
        _qps(1, 2)[:-1] + "," + _qps(8, 9, pid=150)[1:]])
    assert restrack.kernel_counts([147], ["qp"]) == {147: {"qp": 2}}


def test_an_entry_without_its_number_is_an_error() -> None:
    with pytest.raises(restrack.RestrackUnavailable, match="lqpn"):
        restrack.ids_by_pid('[{"ifname":"rxe0","pid":1}]', "qp")
