"""The tools on top of the library: the ``aiordma`` command (:mod:`.cli`), the rxe/VM harness
(:mod:`.rxe`), the demos, the benchmark (:mod:`.bench`) and the helper-process launcher
(:mod:`.process`). They depend on the core and the services; nothing in the core or the
services imports them."""
