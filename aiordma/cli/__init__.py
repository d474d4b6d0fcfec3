"""The ``aiordma`` command (:mod:`.command`): the device table (:mod:`.devices`), rxe on this
host (:mod:`.rxe`), serving and calling the services, and the demos (:mod:`.demo`,
:mod:`.demo_kv`, :mod:`.demo_micro`). The benchmark it runs is :mod:`aiordma.bench`. Nothing
in the core or the services imports this package."""

from .command import main

__all__ = ["main"]
