"""aiordma._resources: what an object adds to the live counts goes back once, by its close()
or, when it is dropped without closing, by the garbage collector (no device needed)."""

from __future__ import annotations

import gc

from aiordma._resources import Share
from aiordma.lowlevel import resource_counts


class Owner:
    pass


def test_a_share_is_given_back_by_close_or_by_the_collector_once() -> None:
    base = resource_counts()["mrs"]
    closed, dropped = Owner(), Owner()
    a = Share(closed, "mrs")
    b = Share(dropped, "mrs")
    b.add()  # e.g. a second registration for expose()
    assert resource_counts()["mrs"] == base + 3
    a.give_back()  # closed: its share is back now...
    del closed, a
    gc.collect()  # ...and not again when it is collected
    assert resource_counts()["mrs"] == base + 2
    del dropped  # dropped unclosed: the collector gives back all of it
    gc.collect()
    assert resource_counts()["mrs"] == base
    del b
