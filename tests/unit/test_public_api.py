"""The public surface is pinned: adding or removing a name is a deliberate change. No device."""

import aiordma
import aiordma.lowlevel


def test_top_level_exports_are_pinned() -> None:
    assert sorted(aiordma.__all__) == sorted([
        "AiordmaError", "AuthenticationError", "BrokenResourceError", "BusyResourceError",
        "ClosedResourceError", "CompletionError", "Config", "ConnectionRejectedError",
        "DeviceError", "Endpoint", "EndpointStats", "Exposure", "Immediate", "Listener", "LocalAccessError",
        "LocalProtocolError", "LocalSlice", "MemoryRegion", "OperationTimeout",
        "PeerUnreachableError", "RemoteAccessError", "RemoteBuffer", "RemoteProtocolError",
        "TcpChannel", "UnsupportedOperationError", "__version__", "connect", "listen",
    ])
    for name in aiordma.__all__:
        assert hasattr(aiordma, name), name


def test_lowlevel_exports_are_pinned() -> None:
    assert sorted(aiordma.lowlevel.__all__) == sorted([
        "CompletionReactor", "Device", "DeviceInfo", "GidInfo", "LocalSlice", "MemoryRegion",
        "PortInfo", "QPAddress", "QueuePair", "RemoteBuffer", "connect_pair", "list_devices",
        "no_device_reason", "open_devices", "resolve_future", "resource_counts", "verbs_path",
    ])


def test_every_error_derives_from_aiordma_error_and_is_documented() -> None:
    for name in aiordma.__all__:
        obj = getattr(aiordma, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, aiordma.AiordmaError), name
            assert obj.__doc__ and len(obj.__doc__) > 20, name


def test_importing_aiordma_does_not_import_pyverbs() -> None:
    import subprocess
    import sys

    code = "import sys, aiordma, aiordma.lowlevel; print('pyverbs' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_rpc_exports_are_pinned() -> None:
    import aiordma.rpc

    assert sorted(aiordma.rpc.__all__) == sorted([
        "Answer", "CallContext", "ClientCall", "NoReplicaError", "PoolStats", "PoolStreamCall",
        "RemoteError",
        "ReplicaStats", "RpcClient", "RpcPool", "RpcServer", "RpcStream", "Service",
        "StreamCall", "Unavailable", "UnknownOutcomeError", "connect", "connect_pool",
        "current_call", "current_endpoint", "ignore_caller_deadline", "method", "serve"])
    assert issubclass(aiordma.rpc.RemoteError, aiordma.AiordmaError)
    assert issubclass(aiordma.rpc.Unavailable, aiordma.rpc.RemoteError)
    # a pool's failures are broken resources: an `except BrokenResourceError` around a call
    # catches them, and they are told apart from each other
    for cls in (aiordma.rpc.NoReplicaError, aiordma.rpc.UnknownOutcomeError):
        assert issubclass(cls, aiordma.BrokenResourceError)
        assert cls.__doc__ and len(cls.__doc__) > 20
    assert not issubclass(aiordma.rpc.NoReplicaError, aiordma.rpc.UnknownOutcomeError)
    assert not issubclass(aiordma.rpc.UnknownOutcomeError, aiordma.rpc.NoReplicaError)


def test_refused_set_ups_are_broken_resources_and_apart_from_each_other() -> None:
    # an existing `except BrokenResourceError` around connect() still catches a refusal, and a
    # caller can tell "try again later" (a limit) from "wrong secret" (retrying is pointless)
    for cls in (aiordma.AuthenticationError, aiordma.ConnectionRejectedError):
        assert issubclass(cls, aiordma.BrokenResourceError)
        assert not issubclass(cls, aiordma.CompletionError)
    assert not issubclass(aiordma.AuthenticationError, aiordma.ConnectionRejectedError)
    assert not issubclass(aiordma.ConnectionRejectedError, aiordma.AuthenticationError)
    err = aiordma.ConnectionRejectedError("refused", reason="too many", category=2)
    assert (err.reason, err.category) == ("too many", 2)
    assert aiordma.AuthenticationError("x", reason="proof").reason == "proof"


def test_transport_and_testing_exports_are_pinned() -> None:
    import aiordma.testing
    import aiordma.transport

    assert aiordma.transport.__all__ == ["MessageChannel", "ReadyChannel"]
    assert sorted(aiordma.testing.__all__) == sorted([
        "CONTRACT", "MemoryChannel", "PairFactory", "channel_pair", "memory_pairs",
        "tcp_pairs"])
    assert len(aiordma.testing.CONTRACT) >= 10


def test_one_error_family_and_one_rule_for_arguments() -> None:
    from aiordma.protocols import errors as wire

    for ours, theirs in ((aiordma.LocalProtocolError, wire.LocalProtocolError),
                         (aiordma.RemoteProtocolError, wire.RemoteProtocolError),
                         (aiordma.AuthenticationError, wire.AuthenticationError)):
        assert issubclass(ours, theirs) and issubclass(ours, aiordma.AiordmaError)
    assert issubclass(aiordma.LocalProtocolError, ValueError)
    assert issubclass(wire.LocalProtocolError, ValueError)
    assert not issubclass(aiordma.RemoteProtocolError, ValueError)
