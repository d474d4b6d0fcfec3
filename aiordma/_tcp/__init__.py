"""The TCP transport: :class:`~aiordma._tcp.channel.TcpChannel` (connections set up by
:mod:`aiordma._endpoint.connect` whose messages travel over TCP)."""
