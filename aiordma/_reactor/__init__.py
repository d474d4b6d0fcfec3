"""The completion reactor: a completion queue's channel fd watched by the event loop
(:mod:`.reactor`), one per event loop and device shared by its queue pairs."""
