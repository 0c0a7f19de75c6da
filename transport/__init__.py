"""The Ray-free client-facing transport and the router: what carries a client's bytes to a
model's serving core and its answer back.

The front's processes on each node (HAProxy's configuration and maps, its supervisor, the
acceptor that hands a connection to a replica), a model replica's listener and its client
connections (HTTP/1.1 and HTTP/2), the relays to the front, and :mod:`router`, which decides
the version and the replica of every request. See docs/architecture.md.
"""
