"""The serving core: one Ray-free object per model version, and the model-control logic.

HTTP, gRPC, the replica listener and Serve's ingress (``rayinfer.deployments``) are thin
translators over :class:`~rayinfer.serving.model_core.ModelCore`. See docs/architecture.md.
"""
