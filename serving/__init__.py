"""The Ray-free part of serving: one serving core per model version, the model-control logic,
a model replica's listener for clients' connections, and the front's processes on each node
(HAProxy's configuration, its supervisor and the acceptor).

HTTP, gRPC, the replica listener and Serve's ingress (``rayinfer.deployments``) are thin
translators over :class:`~rayinfer.serving.model_core.ModelCore`. See docs/architecture.md.
"""
