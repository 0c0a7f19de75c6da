"""rayinfer: a Triton-compatible inference server on Ray Serve.

The implementation lives in the sibling packages ``rayinfer.cluster``, ``rayinfer.deployments``,
``rayinfer.serving``, ``rayinfer.adapters``, ``rayinfer.repository`` and ``rayinfer.protocol``
(the top-level folders of the source tree).
"""

__version__ = "0.1.0"
