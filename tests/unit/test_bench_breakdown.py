"""The breakdown tool's device-free parts run, tiny, on both loops (no device)."""

from __future__ import annotations

import pytest

from aiordma.bench import breakdown


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_loop_figures_are_measured(loop: str) -> None:
    assert breakdown.floor(loop, n=50) > 0
    assert breakdown.rpc_over_channel_pair(loop, n=20) > 0


def test_the_protocol_figures_deliver_every_message() -> None:
    # (message_protocol_steps pops each message on the receiving side: an undelivered one
    # raises LocalProtocolError "the inbox is empty"; 300 > the 64 credits, so credits return)
    assert breakdown.message_protocol_steps(n=300) > 0
    assert breakdown.rpc_protocol_steps(n=50) > 0


def test_main_prints_a_row_per_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert breakdown.main(["--repeat", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all(line.endswith(" us") for line in out)
