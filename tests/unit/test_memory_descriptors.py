"""RemoteBuffer descriptors and buffer addresses: pure logic, no device."""

import mmap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma import LocalProtocolError, RemoteBuffer
from aiordma._memory.region import buffer_address

U64 = st.integers(0, 2**64 - 1)


@given(address=U64, rkey=st.integers(0, 2**32 - 1), length=st.integers(0, 2**40),
       r=st.booleans(), w=st.booleans(), a=st.booleans())
def test_wire_round_trip(address: int, rkey: int, length: int, r: bool, w: bool, a: bool) -> None:
    rb = RemoteBuffer(address=address, rkey=rkey, length=length, readable=r, writable=w, atomic=a)
    assert RemoteBuffer.from_wire(rb.to_wire()) == rb
    assert RemoteBuffer.from_wire(list(rb.to_wire())) == rb  # msgpack gives lists back


@pytest.mark.parametrize("wire", [None, (1, 2, 3), (1, 2, 3, "x"), (-1, 2, 3, 0), "abcd", 5])
def test_malformed_descriptors_are_typed_errors(wire: object) -> None:
    with pytest.raises(LocalProtocolError):
        RemoteBuffer.from_wire(wire)


@given(length=st.integers(0, 10_000), start=st.integers(0, 10_000), stop=st.integers(0, 10_000))
def test_slices_stay_inside_the_descriptor(length: int, start: int, stop: int) -> None:
    rb = RemoteBuffer(address=4096, rkey=7, length=length, writable=True)
    if start > length or stop > length:
        with pytest.raises(LocalProtocolError):
            rb[start:stop]
        return
    sub = rb[start:stop]
    assert sub.address == 4096 + start
    assert sub.length == max(0, stop - start)
    assert sub.address + sub.length <= rb.address + rb.length
    assert sub.rkey == 7 and sub.writable


def test_buffer_address_of_common_buffers() -> None:
    b = bytearray(100)
    addr, n, ro = buffer_address(b)
    assert n == 100 and not ro and addr != 0
    assert buffer_address(memoryview(b)[10:])[0] == addr + 10
    assert buffer_address(b"abc")[2] is True
    m = mmap.mmap(-1, 8192)
    assert buffer_address(m)[1] == 8192
    m.close()


def test_non_contiguous_buffer_is_refused() -> None:
    with pytest.raises(LocalProtocolError):
        buffer_address(memoryview(bytearray(10))[::2])
