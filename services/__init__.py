"""Services built on aiordma's RPC layer (key-value store, collectives, echo)."""
