"""Memory: registered regions, slices of them and descriptors of a peer's memory
(:mod:`.region`), and exposures of a range to one connection through memory windows
(:mod:`.window`)."""
