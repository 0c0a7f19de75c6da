"""Serve's servicer function for GRPCInferenceService (no Ray cluster)."""

from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor
from unittest.mock import Mock

import grpc
from ray.serve._private.utils import import_attr
from tritonclient.grpc import service_pb2 as pb

from rayinfer.deployments.grpc_service import SERVICER_FUNCTION


def test_servicer_function_registers_the_service_and_makes_messages_picklable():
    server = grpc.server(ThreadPoolExecutor(1))
    add = import_attr(SERVICER_FUNCTION)  # the way Serve resolves grpc_servicer_functions
    add(Mock(), server)
    # Serve's gRPC proxy pickles the requests it forwards.
    request = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\1\2"])
    assert pickle.loads(pickle.dumps(request)) == request
    config = pb.ModelConfigResponse()
    config.config.max_batch_size = 4
    assert pickle.loads(pickle.dumps(config)).config.max_batch_size == 4
    server.stop(None)
