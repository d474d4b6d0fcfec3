"""Devices: finding RDMA devices, ports and GIDs (:mod:`.discovery`), opening one
(:mod:`.device`: a verbs context and protection domain), and noticing its loss (:mod:`.watch`)."""
