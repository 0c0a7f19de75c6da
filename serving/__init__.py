"""The Ray-free serving core: one :class:`~rayinfer.serving.model_core.ModelCore` per model
version (its batcher, sequencer and executor), the translators from HTTP and gRPC to it, the
model-control logic, rollouts' analysis, tracing and the response cache.

It knows nothing of clients' connections: those are :mod:`rayinfer.transport`'s. See
docs/architecture.md.
"""
