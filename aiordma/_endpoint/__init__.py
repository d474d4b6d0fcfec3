"""Connected endpoints: reliable-connected queue pairs and their bring-up (:mod:`.qp`), the
:class:`~aiordma.Endpoint` (messages over the credit protocol, one-sided operations), and
``connect``/``listen`` (:mod:`.connect`: the TCP side channel's handshake)."""
