"""Call metadata, interceptors and deadline propagation in the RPC layer, over the in-memory
channel pair (no device; the same over rxe with the server in another process:
tests/rxe/test_rpc_ops.py).

* metadata reaches the method (``current_call()``, in ``async def`` and plain ``def``
  methods and in stream calls) and the answer's reaches the caller (``call_with_metadata``,
  ``RemoteError.metadata``, ``StreamCall.answer_metadata``); bad metadata is refused before
  anything is sent, and bad answer metadata fails that call only;
* server and client interceptors run in order around every call (unary and a stream's
  opening), see its method, arguments, metadata and deadline, change metadata both ways,
  time it, reject it typed (the method not run), and a server interceptor cannot run a
  method twice;
* a call made by a method inherits what is left of its caller's deadline (its own timeout
  when shorter), unless ``ignore_caller_deadline()``; an inherited deadline that passes fails
  the inner call typed and cancels its server's task.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiordma import LocalProtocolError, OperationTimeout
from aiordma.rpc import (
    Answer,
    ClientCall,
    RemoteError,
    Unavailable,
    current_call,
    ignore_caller_deadline,
)

from ..bounds import STEP
from ..rpc_ops_services import Traced, auth, recording, served, timing, with_token
from .rpc_builds import rpc_layer_build  # noqa: F401  # (each test with both builds)
from .test_rpc_over_memory import counting_sends

MD = {"request-id": "r-1", "trace.parent": "00-abc-01", "token-bin": b"\x00\xff",
      "echo-me": "back"}


@pytest.mark.usefixtures("over")
async def test_metadata_reaches_the_method_and_the_answers_reaches_the_caller() -> None:
    async with served(Traced()) as ([client], _):
        for name in ("whoami", "whoami_now"):  # a task per call; inline
            result, answer_md = await asyncio.wait_for(
                client.call_with_metadata(name, metadata=MD), STEP)
            assert result["method"] == name and result["metadata"] == MD
            assert answer_md == {"served-by": "traced", "echo-me": "back"}
        # call() takes the same metadata and returns the result alone
        seen = await asyncio.wait_for(client.call("whoami", 1, metadata={"k": "v"}), STEP)
        assert seen["metadata"] == {"k": "v"} and seen["args"] == [1]
        # no metadata: the method sees an empty mapping; the answer's is still returned
        got = await asyncio.wait_for(client.call_with_metadata("whoami"), STEP)
        assert isinstance(got, Answer) and got.result["metadata"] == {}
        assert got.metadata == {"served-by": "traced"}
        # an error answer carries its metadata too
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.call("fail_with", "no", metadata=MD), STEP)
        assert info.value.type_name == "ValueError" and info.value.metadata == {"why": "no"}


@pytest.mark.usefixtures("over")
async def test_stream_calls_carry_metadata_both_ways() -> None:
    async with served(Traced()) as ([client], _), client.stream(
            "rows", 5, metadata={"a": "1", "b": b"2"}, timeout=STEP) as rows:
        assert rows.answer_metadata == {}  # (not answered yet)
        assert [i async for i in rows] == list(range(5))
        assert rows.answer_metadata == {"sent": "5", "saw": "a,b"}


@pytest.mark.usefixtures("over")
@pytest.mark.parametrize("bad", [
    {"Upper": "v"}, {"": "v"}, {"k": 1}, {"k": None}, {"k": "v" * 4097}, [("k", "v")], "k=v",
    {f"k{i}": "" for i in range(65)}, {"k": "\ud800"}])
async def test_bad_metadata_is_refused_before_anything_is_sent(bad: Any) -> None:
    async with served(Traced()) as ([client], _):
        sent = counting_sends(client.endpoint)
        for make in (lambda: client.call("whoami", metadata=bad),
                     lambda: client.call_with_metadata("whoami", metadata=bad)):
            with pytest.raises(LocalProtocolError):
                await asyncio.wait_for(make(), STEP)
        with pytest.raises(LocalProtocolError):
            client.stream("rows", 1, metadata=bad)
        assert sent[0] == 0
        assert (await asyncio.wait_for(client.call("whoami", metadata={"ok": "1"}), STEP)
                )["metadata"] == {"ok": "1"}


@pytest.mark.usefixtures("over")
async def test_bad_answer_metadata_fails_that_call_only() -> None:
    async with served(Traced()) as ([client], _):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.call("bad_answer_metadata"), STEP)
        assert info.value.type_name == "LocalProtocolError"
        assert "Not A Key" in info.value.message and info.value.metadata == {}
        assert (await asyncio.wait_for(client.call("whoami"), STEP))["method"] == "whoami"


# -- interceptors -----------------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_server_interceptors_run_in_order_see_the_call_and_change_metadata() -> None:
    log: list[Any] = []
    interceptors = [recording(log, "outer"), auth, recording(log, "inner"), timing]
    async with served(Traced(), interceptors=interceptors,
                      client_interceptors=[with_token("good")]) as ([client], server):
        result, answer_md = await asyncio.wait_for(client.call_with_metadata(
            "whoami", 7, timeout=STEP, metadata={"echo-x": "y"}), STEP)
        # the method saw the metadata as auth left it: the token gone, the user added
        assert result["metadata"] == {"echo-x": "y", "user": "alice"}
        # (a deadline travels in whole milliseconds, rounded up: "all of it left" may read
        # up to 1 ms above STEP, and an ulp more from the clock sums)
        assert result["args"] == [7] and 0 < result["remaining"] <= STEP + 0.001
        assert answer_md["auth"] == "ok" and answer_md["echo-x"] == "y"
        assert float(answer_md["server-ms"]) >= 0
        assert log == [
            ("outer", "in", "whoami", {"echo-x": "y", "token": "good"}, True),
            ("inner", "in", "whoami", {"echo-x": "y", "user": "alice"}, True),
            ("inner", "out", "whoami"), ("outer", "out", "whoami")]
        # plain def methods go through the chain too (in a task then)
        assert (await asyncio.wait_for(client.call("whoami_now"), STEP))["metadata"] == {
            "user": "alice"}
        assert server.stats()["methods"]["whoami"]["calls"] == 1


@pytest.mark.usefixtures("over")
async def test_a_server_interceptor_rejects_typed_and_the_method_does_not_run() -> None:
    traced = Traced()
    log: list[Any] = []
    async with served(traced, interceptors=[auth, recording(log, "after")]) as ([client], server):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.call("whoami", metadata={"token": "bad"}), STEP)
        assert (info.value.type_name, info.value.message) == ("PermissionError",
                                                             "no valid token")
        assert info.value.metadata == {"auth": "refused"}
        with pytest.raises(RemoteError, match="no valid token"):
            async for _ in client.stream("rows", 3, timeout=STEP):
                pass
        assert traced.ran == {} and log == []
        st = server.stats()["methods"]
        assert (st["whoami"]["calls"], st["whoami"]["errors"], st["rows"]["errors"]) == (1, 1, 1)


@pytest.mark.usefixtures("over")
async def test_an_interceptor_refusal_with_unavailable_says_the_method_did_not_run() -> None:
    """Unavailable raised before proceeding is a refusal (the caller may call elsewhere);
    raised after the method ran, it is an ordinary error."""
    traced = Traced()

    async def shed(call: Any, proceed: Any) -> Any:
        if call.metadata.get("shed"):
            raise Unavailable("shedding load")
        result = await proceed()
        if call.metadata.get("late"):
            raise Unavailable("too late to refuse")
        return result

    async with served(traced, interceptors=[shed]) as ([client], server):
        with pytest.raises(Unavailable) as info:
            await asyncio.wait_for(client.call("whoami", metadata={"shed": "1"}), STEP)
        assert info.value.message == "shedding load"
        with pytest.raises(RemoteError) as late:
            await asyncio.wait_for(client.call("whoami", metadata={"late": "1"}), STEP)
        assert not isinstance(late.value, Unavailable) and late.value.type_name == "Unavailable"
        assert traced.ran == {"whoami": 1}
        st = server.stats()["methods"]["whoami"]
        assert (st["calls"], st["refused"], st["errors"]) == (2, 1, 1)


@pytest.mark.usefixtures("over")
async def test_a_server_interceptor_cannot_run_the_method_twice() -> None:
    traced = Traced()

    async def twice(call: Any, proceed: Any) -> Any:
        await proceed()
        return await proceed()

    async with served(traced, interceptors=[twice]) as ([client], _):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.call("whoami"), STEP)
        assert info.value.type_name == "LocalProtocolError" and "twice" in info.value.message
        assert traced.ran == {"whoami": 1}


@pytest.mark.usefixtures("over")
async def test_server_interceptors_see_a_streams_opening_and_its_end() -> None:
    log: list[Any] = []
    async with served(Traced(), interceptors=[recording(log, "s"), timing]) as ([client], _):
        async with client.stream("rows", 50, metadata={"m": "1"}, window=2) as rows:
            assert await anext(rows) == 0
            assert log == [("s", "in", "rows", {"m": "1"}, False)]  # open, not ended
            assert [i async for i in rows] == list(range(1, 50))
        assert log[-1] == ("s", "out", "rows")
        assert set(rows.answer_metadata) == {"sent", "saw", "server-ms"}


@pytest.mark.usefixtures("over")
async def test_client_interceptors_run_in_order_change_metadata_and_see_the_answer() -> None:
    log: list[Any] = []
    answers: list[Any] = []

    async def read_answer(call: ClientCall, proceed: Any) -> Any:
        result = await proceed()
        answers.append(dict(call.answer_metadata or {}))
        call.answer_metadata = {**(call.answer_metadata or {}), "client": "seen"}
        return {"wrapped": result["metadata"]}

    async with served(Traced(), client_interceptors=[
            recording(log, "outer"), with_token("t"), read_answer,
            recording(log, "inner")]) as ([client], _):
        got = await asyncio.wait_for(client.call_with_metadata(
            "whoami", metadata={"echo-a": "b"}, timeout=STEP), STEP)
        assert got.result == {"wrapped": {"echo-a": "b", "token": "t"}}
        assert got.metadata == {"served-by": "traced", "echo-a": "b", "client": "seen"}
        assert answers == [{"served-by": "traced", "echo-a": "b"}]
        assert log == [("outer", "in", "whoami", {"echo-a": "b"}, True),
                       ("inner", "in", "whoami", {"echo-a": "b", "token": "t"}, True),
                       ("inner", "out", "whoami"), ("outer", "out", "whoami")]


@pytest.mark.usefixtures("over")
async def test_a_client_interceptor_rejects_before_anything_is_sent() -> None:
    async def deny(call: ClientCall, proceed: Any) -> Any:
        if call.method == "hold":
            raise PermissionError(f"{call.method} is not for this client")
        return await proceed()

    traced = Traced()
    async with served(traced, client_interceptors=[deny]) as ([client], _):
        sent = counting_sends(client.endpoint)
        with pytest.raises(PermissionError):
            await asyncio.wait_for(client.call("hold", 0), STEP)
        with pytest.raises(PermissionError):
            async with client.stream("hold", 0):
                pass
        assert sent[0] == 0 and traced.ran == {}
        assert (await asyncio.wait_for(client.call("whoami"), STEP))["method"] == "whoami"


@pytest.mark.usefixtures("over")
async def test_a_client_interceptor_may_call_again_and_sees_a_streams_opening() -> None:
    calls: list[Any] = []

    async def retry_once(call: ClientCall, proceed: Any) -> Any:
        calls.append((call.method, call.stream))
        try:
            return await proceed()
        except RemoteError:
            return await proceed()  # (a retry: the call is made again)

    traced = Traced()
    async with served(traced, client_interceptors=[retry_once]) as ([client], _):
        with pytest.raises(RemoteError):
            await asyncio.wait_for(client.call("fail_with", "x"), STEP)
        assert traced.ran == {"fail_with": 2}
        async with client.stream("rows", 2, timeout=STEP) as rows:
            assert [i async for i in rows] == [0, 1]
        assert calls == [("fail_with", False), ("rows", True)]


@pytest.mark.parametrize("bad", [[1], ["not callable"], 5, None, object()])
async def test_interceptors_must_be_a_list_of_callables(bad: Any) -> None:
    from aiordma.rpc import RpcClient, RpcServer
    from aiordma.testing import channel_pair

    a, _ = channel_pair()
    with pytest.raises(LocalProtocolError):
        RpcServer(Traced(), max_in_flight=1, grace=1.0, interceptors=bad)
    with pytest.raises(LocalProtocolError):
        RpcClient(a, max_in_flight=1, interceptors=bad)
    a.abort()


# -- deadline propagation ---------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_a_method_calls_with_what_is_left_of_its_callers_deadline() -> None:
    """A -> B: B sees a deadline no later than A's (the inner call's own timeout when that is
    shorter); none with ignore_caller_deadline(); none when A's caller set none. (A deadline
    travels in whole milliseconds, rounded up: hence the 1 ms.)"""
    ms = 0.001
    async with served(Traced()) as ([b_client], _), served(Traced()) as ([a_client], a_srv):
        a_srv.service.downstream = b_client  # type: ignore[attr-defined]
        for inner in (None, 100.0):  # none of its own, or a longer one: A's caller's
            seen = await asyncio.wait_for(a_client.call("relay", "whoami", inner_timeout=inner,
                                                        timeout=30), STEP)
            assert 0 < seen["remaining"] <= 30 + ms
        seen = await asyncio.wait_for(a_client.call("relay", "whoami", inner_timeout=2,
                                                     timeout=30), STEP)
        assert 0 < seen["remaining"] <= 2 + ms
        seen = await asyncio.wait_for(a_client.call("relay", "whoami", ignore=True,
                                                     timeout=30), STEP)
        assert seen["remaining"] is None
        seen = await asyncio.wait_for(a_client.call("relay", "whoami", ignore=True,
                                                     inner_timeout=20, timeout=5), STEP)
        assert 5 < seen["remaining"] <= 20 + ms
        seen = await asyncio.wait_for(a_client.call("relay", "whoami"), STEP)
        assert seen["remaining"] is None


@pytest.mark.usefixtures("over")
async def test_an_inherited_deadline_that_passes_fails_the_inner_call_and_cancels_it() -> None:
    """B holds for 30 s; A's caller gave 0.3 s. The inner call is bounded by that (B's task is
    cancelled, B counts it expired or cancelled), even though A itself keeps waiting for
    it (it catches nothing)."""
    b = Traced()

    async def relay_and_report(call: Any, proceed: Any) -> Any:  # (sees the inner failure)
        try:
            return await proceed()
        except OperationTimeout as exc:
            return {"inner": "OperationTimeout", "text": str(exc)}

    async with served(b) as ([b_client], b_srv), served(
            Traced(), interceptors=[relay_and_report]) as ([a_client], a_srv):
        a_srv.service.downstream = b_client  # type: ignore[attr-defined]
        try:
            got = await asyncio.wait_for(a_client.call("relay", "hold", 30.0, timeout=0.3),
                                         STEP)
        except OperationTimeout:  # A's own clock (same deadline) may fire first
            got = None
        deadline = asyncio.get_running_loop().time() + STEP
        while b.hold_cancelled == 0:
            assert asyncio.get_running_loop().time() < deadline, "B's hold was not cancelled"
            await asyncio.sleep(0.01)
        assert b.finished == 0
        if got is not None:
            assert got["inner"] == "OperationTimeout" and "inherited" in got["text"]
        st = b_srv.stats()["methods"]["hold"]
        assert st["expired"] + st["cancelled"] == 1 and st["in_flight"] == 0


@pytest.mark.usefixtures("over")
async def test_tasks_a_method_starts_inherit_its_deadline_unless_told_not_to() -> None:
    seen: list[Any] = []
    a = Traced()

    async def spawn(call: Any, proceed: Any) -> Any:
        assert current_call() is call

        async def later(ignore: bool) -> None:
            if ignore:
                with ignore_caller_deadline():
                    seen.append(("ignored", await b_client.call("whoami")))
            else:
                seen.append(("inherited", await b_client.call("whoami")))
        await asyncio.gather(asyncio.create_task(later(False)), asyncio.create_task(later(True)))
        return await proceed()

    async with served(Traced()) as ([b_client], _), served(
            a, interceptors=[spawn]) as ([a_client], _):
        await asyncio.wait_for(a_client.call("whoami", timeout=30), STEP)
    got = {k: v["remaining"] for k, v in seen}
    assert got["ignored"] is None and 0 < got["inherited"] <= 30


async def test_current_call_outside_a_call_is_a_lookup_error() -> None:
    with pytest.raises(LookupError):
        current_call()
    with ignore_caller_deadline():  # harmless outside a call
        pass
