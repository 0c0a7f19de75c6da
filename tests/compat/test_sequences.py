"""Triton's sequence batcher through unmodified tritonclient, over HTTP and gRPC (and gRPC
streams): the flows of Triton's sequence client examples on the example repository's
``simple_sequence``, ``simple_dyna_sequence`` and ``simple_string_dyna_sequence``, implicit
state with an initial state from a file, a Python model keeping state per correlation id, and
Triton's errors for requests that break a sequence's rules."""

from __future__ import annotations

import queue
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from sequence_models import INITIAL_VALUE
from waiting import wait_until

VALUES = [11, 7, 5, 3, 2, 0, 1]


def _send(module: Any, client: Any, model: str, sequence_id: int | str, values: list[int],
          output: str = "OUTPUT") -> list[int]:
    """One sequence, one synchronous request per value, as Triton's sync sequence clients send it."""
    results = []
    for index, value in enumerate(values):
        data = np.full((1, 1), value, np.int32)
        inp = module.InferInput("INPUT", list(data.shape), "INT32")
        inp.set_data_from_numpy(data)
        result = client.infer(model, [inp], outputs=[module.InferRequestedOutput(output)], sequence_id=sequence_id,
                              sequence_start=index == 0, sequence_end=index == len(values) - 1)
        results.append(int(result.as_numpy(output)[0][0]))
    return results


def _expected(dyna: bool, string_ids: bool, sequence_id: int, first: int, negate: bool,
              previous: list[int] | None = None) -> list[int]:
    """What Triton's sequence client examples check for one sequence."""
    sign = -1 if negate else 1
    if string_ids and dyna:  # the string dyna model accumulates
        out = [first]
        for value in VALUES:
            out.append(out[-1] + sign * value)
        out[-1] += sequence_id
        return out
    out = [first + 1] + [sign * v for v in VALUES]
    if dyna:
        out[-1] += sequence_id
    return out


@pytest.mark.parametrize("dyna", [False, True], ids=["simple_sequence", "dyna"])
def test_tritons_sync_sequence_client_flow(proto: tuple[Any, Any], dyna: bool) -> None:
    module, client = proto
    model = "simple_dyna_sequence" if dyna else "simple_sequence"
    string_model = "simple_string_dyna_sequence" if dyna else "simple_sequence"
    string_id = "1002" if dyna else str(uuid.uuid4())
    seq0 = _send(module, client, model, 1000, [0] + VALUES)
    seq1 = _send(module, client, model, 1001, [100] + [-v for v in VALUES])
    seq2 = _send(module, client, string_model, string_id, [20] + [-v for v in VALUES])
    assert seq0 == _expected(dyna, False, 1000, 0, False)
    assert seq1 == _expected(dyna, False, 1001, 100, True)
    expected_string = _expected(dyna, True, 1002, 20, True) if dyna else [21] + [-v for v in VALUES]
    assert seq2 == expected_string


def test_tritons_stream_sequence_client_flow(server: dict[str, Any]) -> None:
    """Three sequences interleaved on one gRPC stream, as simple_grpc_sequence_stream_infer_client
    --dyna sends them; answers are told apart by request id."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    sequences = {"1000": ("simple_dyna_sequence", 1000, [0] + VALUES),
                 "1001": ("simple_dyna_sequence", 1001, [100] + [-v for v in VALUES]),
                 "1002": ("simple_string_dyna_sequence", "1002", [20] + [-v for v in VALUES])}
    with grpcclient.InferenceServerClient(server["grpc_url"]) as client:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for key, (model, sequence_id, values) in sequences.items():
            for index, value in enumerate(values):
                inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                inp.set_data_from_numpy(np.full((1, 1), value, np.int32))
                client.async_stream_infer(model, [inp], outputs=[grpcclient.InferRequestedOutput("OUTPUT")],
                                          request_id=f"{key}_{index}", sequence_id=sequence_id,
                                          sequence_start=index == 0, sequence_end=index == len(values) - 1)
        got: dict[str, dict[int, int]] = {key: {} for key in sequences}
        for _ in range(3 * (len(VALUES) + 1)):
            answer = answers.get(timeout=60)
            assert not isinstance(answer, InferenceServerException), answer
            key, index = answer.get_response().id.split("_")
            got[key][int(index)] = int(answer.as_numpy("OUTPUT")[0][0])
        client.stop_stream()
    assert [got["1000"][i] for i in range(8)] == _expected(True, False, 1000, 0, False)
    assert [got["1001"][i] for i in range(8)] == _expected(True, False, 1001, 100, True)
    assert [got["1002"][i] for i in range(8)] == _expected(True, True, 1002, 20, True)


def _own_client(module: Any, server: dict[str, Any]) -> Any:
    """A client per sequence: an HTTP client holds one connection, so sequences sharing it would
    wait on each other (one waiting for a slot would hold the connection the others need)."""
    return module.InferenceServerClient(server["url"] if module.__name__.endswith("http") else server["grpc_url"])


def test_implicit_state_starts_from_the_initial_state_and_sequences_keep_their_own(
        proto: tuple[Any, Any], server: dict[str, Any]) -> None:
    """Six sequences at once on four direct slots: two wait for a slot; each sums its own inputs
    from the initial state (100) read from the model's initial_state folder."""
    module, _ = proto
    base = 5000 if module.__name__.endswith("http") else 6000

    def one(k: int) -> list[int]:
        with _own_client(module, server) as client:
            return _send(module, client, "seq_state_direct", base + k, [k + 1] * 5)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert results == [[INITIAL_VALUE + (k + 1) * n for n in range(1, 6)] for k in range(6)]


def test_a_sequence_passes_through_an_ensemble_to_its_stateful_step(
        proto: tuple[Any, Any], server: dict[str, Any]) -> None:
    """The ensemble's correlation id and flags reach its step, which keeps the state."""
    module, _ = proto
    base = 7000 if module.__name__.endswith("http") else 8000

    def one(k: int) -> list[int]:
        with _own_client(module, server) as client:
            return _send(module, client, "seq_ensemble", base + k, [k + 2] * 4, output="TOTAL")

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, range(2)))
    assert results == [[INITIAL_VALUE + (k + 2) * n for n in range(1, 5)] for k in range(2)]


def test_python_model_keeps_state_per_string_correlation_id(proto: tuple[Any, Any], server: dict[str, Any]) -> None:
    """Three sequences at once (string ids) on a Python model that keeps a sum per
    ``correlation_id()`` and answers with ``flags()``."""
    module, _ = proto
    prefix = module.__name__.rsplit(".", 1)[-1]

    def one(k: int) -> list[tuple[int, int]]:
        out = []
        with _own_client(module, server) as client:
            for index in range(4):
                inp = module.InferInput("INPUT", [1, 1], "INT32")
                inp.set_data_from_numpy(np.full((1, 1), 10 * k + index, np.int32))
                result = client.infer("seq_python", [inp], sequence_id=f"{prefix}-{k}",
                                      sequence_start=index == 0, sequence_end=index == 3)
                out.append((int(result.as_numpy("SUM")[0][0]), int(result.as_numpy("FLAGS")[0][0])))
        return out

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, range(3)))
    for k, result in enumerate(results):
        sums = np.cumsum([10 * k + i for i in range(4)]).tolist()
        assert result == list(zip(sums, [1, 0, 0, 2]))


def test_requests_breaking_a_sequences_rules_get_tritons_errors(proto: tuple[Any, Any]) -> None:
    module, client = proto
    inp = module.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.ones((1, 1), np.int32))
    with pytest.raises(InferenceServerException) as not_started:
        client.infer("simple_sequence", [inp], sequence_id=424242)
    assert ("inference request for sequence 424242 to model 'simple_sequence' must specify the START flag on the "
            "first request of the sequence") in str(not_started.value)
    with pytest.raises(InferenceServerException) as no_id:
        client.infer("simple_sequence", [inp], sequence_start=True)
    assert ("inference request to model 'simple_sequence' must specify a non-zero or non-empty correlation ID"
            in str(no_id.value))
    two = module.InferInput("INPUT", [2, 1], "INT32")
    two.set_data_from_numpy(np.ones((2, 1), np.int32))
    with pytest.raises(InferenceServerException) as batch:
        client.infer("simple_sequence", [two], sequence_id=434343, sequence_start=True)
    assert ("inference request to model 'simple_sequence' must specify batch-size 1 due to requirements of "
            "sequence batcher") in str(batch.value)
    if module.__name__.endswith("http"):
        assert not_started.value.status() == "400"
    else:
        assert not_started.value.status() == "StatusCode.INVALID_ARGUMENT"
    # The model still serves.
    assert _send(module, client, "simple_sequence", 454545, [3, 4]) == [4, 4]


def _grow(module: Any, client: Any, sequence_id: int, value: int, **options: Any) -> list[int]:
    inp = module.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.full((1, 1), value, np.int32))
    return client.infer("seq_growing", [inp], sequence_id=sequence_id, **options).as_numpy("HISTORY")[0].tolist()


def test_a_state_grows_with_its_sequence(proto: tuple[Any, Any]) -> None:
    """A state with dims [ -1 ] (and Triton's use_growable_memory) takes the shape the model
    gives it: the history grows by one element per request, from the zero initial state."""
    module, client = proto
    sequence_id = 9100 if module.__name__.endswith("http") else 9200
    histories = [_grow(module, client, sequence_id, value, sequence_start=value == 1, sequence_end=value == 4)
                 for value in (1, 2, 3, 4)]
    assert histories == [[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]


def test_a_sequence_waiting_for_a_slot_past_its_timeout_is_rejected(proto: tuple[Any, Any],
                                                                   server: dict[str, Any]) -> None:
    """Triton's schedule policy for sequences: a request's ``timeout`` bounds its sequence's wait
    for a slot. ``seq_growing`` has one slot; while a sequence holds it, another sequence's START
    with a 200 ms timeout fails with Triton's UNAVAILABLE error and counts as a failed request,
    that sequence must START again, and the holder runs on unaffected."""
    module, _ = proto
    http = module.__name__.endswith("http")
    holder_id, waiter_id = (9300, 9301) if http else (9400, 9401)
    with _own_client(module, server) as holder, _own_client(module, server) as waiter:
        def failures() -> int:  # (gRPC's JSON form leaves out counts of zero, and writes int64s as strings)
            stats = waiter.get_inference_statistics("seq_growing", **({} if http else {"as_json": True}))
            return int(stats["model_stats"][0]["inference_stats"].get("fail", {}).get("count", 0))

        failed_before = failures()
        assert _grow(module, holder, holder_id, 7, sequence_start=True, timeout=1_000) == [0, 7]
        with pytest.raises(InferenceServerException) as timed_out:
            _grow(module, waiter, waiter_id, 1, sequence_start=True, timeout=200_000)
        assert "timeout of the corresponding sequence has been expired" in str(timed_out.value)
        assert timed_out.value.status() == ("503" if http else "StatusCode.UNAVAILABLE")
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            _grow(module, waiter, waiter_id, 2)
        assert _grow(module, holder, holder_id, 8, sequence_end=True) == [0, 7, 8]
        wait_until(lambda: failures() == failed_before + 1, "the rejected request in the model's statistics",
                   timeout_s=10, interval_s=0.2)
        # The slot is free again: the waiter's sequence may start now.
        assert _grow(module, waiter, waiter_id, 3, sequence_start=True, sequence_end=True, timeout=200_000) == [0, 3]


def _iter_input(module: Any, value: int) -> Any:
    inp = module.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([value], np.int32))
    return inp


def test_iterative_requests_run_again_until_their_model_completes_them(proto: tuple[Any, Any],
                                                                      server: dict[str, Any]) -> None:
    """iterative_sequence (Triton's request rescheduling), as Triton's own tests send it: plain
    requests, no sequence id; the model reschedules each until its countdown ends, and each is
    answered once, with how many times it ran, under its own correlation id."""
    module, _ = proto
    url = server["url"] if module.__name__.endswith("http") else server["grpc_url"]

    def countdown(n: int) -> Any:  # a client per thread: tritonclient.http's is not thread-safe
        client = module.InferenceServerClient(url)
        try:
            return client.infer("iter_countdown", [_iter_input(module, n)])
        finally:
            client.close()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(countdown, [3, 1, 4, 2]))
    assert [int(r.as_numpy("OUT")[0]) for r in results] == [3, 1, 4, 2]
    ids = [int(r.as_numpy("CORRID")[0]) for r in results]
    assert len(set(ids)) == 4 and min(ids) > 0


def test_an_iterative_decoupled_model_streams_each_run(server: dict[str, Any]) -> None:
    """Triton's iterative_sequence example: IN=3 on a stream, no sequence id: OUT 2, 1, 0."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server["grpc_url"])
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        client.async_stream_infer("iter_stream", [_iter_input(grpcclient, 3)], request_id="a")
        outs = [answers.get(timeout=30) for _ in range(3)]
        assert [int(r.as_numpy("OUT")[0]) for r in outs] == [2, 1, 0]
        assert len({int(r.as_numpy("CORRID")[0]) for r in outs}) == 1
    finally:
        client.stop_stream()
        client.close()


def test_rescheduling_without_iterative_sequence_gets_tritons_error(proto: tuple[Any, Any]) -> None:
    module, client = proto
    with pytest.raises(InferenceServerException, match="Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, "
                                                       "while the model is not configured to handle such a flag."):
        client.infer("iter_not_iterative", [_iter_input(module, 1000)])
    # It serves on: a request it does not reschedule is answered.
    assert client.infer("iter_not_iterative", [_iter_input(module, 0)]).as_numpy("OUT").shape == (1,)


def test_server_lists_the_sequence_extension(proto: tuple[Any, Any]) -> None:
    module, client = proto
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if isinstance(metadata, dict) else list(metadata.extensions)
    assert "sequence" in extensions


def test_each_sequence_stays_on_one_of_two_replicas_over_every_protocol(server: dict[str, Any]) -> None:
    """``seq_python`` runs two replicas (instance_group count 2), each with its own sums: twelve
    sequences (integer and string ids, four at a time) whose requests alternate between HTTP,
    gRPC and a gRPC stream all keep their sums, each on one replica, and both replicas get some."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    answers: queue.Queue = queue.Queue()
    http = httpclient.InferenceServerClient(server["url"])
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    stream = grpcclient.InferenceServerClient(server["grpc_url"])
    stream.start_stream(callback=lambda result, error: answers.put(error or result))

    def send(step: int, sequence_id: int | str, value: int) -> Any:
        flags = {"sequence_id": sequence_id, "sequence_start": step == 0, "sequence_end": step == 3}
        module = httpclient if step % 3 == 0 else grpcclient
        inp = module.InferInput("INPUT", [1, 1], "INT32")
        inp.set_data_from_numpy(np.full((1, 1), value, np.int32))
        if step % 3 == 0:
            return http.infer("seq_python", [inp], **flags)
        if step % 3 == 1:
            return grpc.infer("seq_python", [inp], **flags)
        stream.async_stream_infer("seq_python", [inp], **flags)
        answer = answers.get(timeout=30)
        if isinstance(answer, Exception):
            raise answer
        return answer

    pids: dict[int | str, set[int]] = {}
    try:
        for round_ in range(3):
            ids: list[int | str] = [7000 + round_, 8000 + round_, f"r{round_}-a", f"r{round_}-b"]
            sums = {sequence_id: [] for sequence_id in ids}
            for step in range(4):
                for k, sequence_id in enumerate(ids):
                    result = send(step, sequence_id, 10 * k + step)
                    sums[sequence_id].append((int(result.as_numpy("SUM")[0][0]), int(result.as_numpy("FLAGS")[0][0])))
                    pids.setdefault(sequence_id, set()).add(int(result.as_numpy("PID")[0][0]))
            for k, sequence_id in enumerate(ids):
                expected = np.cumsum([10 * k + step for step in range(4)]).tolist()
                assert sums[sequence_id] == list(zip(expected, [1, 0, 0, 2])), sequence_id
    finally:
        stream.stop_stream()
        for client in (http, grpc, stream):
            client.close()
    assert all(len(replica) == 1 for replica in pids.values()), pids
    assert len(set().union(*pids.values())) == 2, pids


def test_a_sequence_whose_replica_died_fails_and_the_others_go_on(server: dict[str, Any]) -> None:
    """Four sequences on ``seq_python``'s two replicas; one replica's process is killed. Its
    sequences fail with Triton's error for a sequence that was not started (never a silent new
    sum elsewhere); the other replica's go on to their end, also after Serve's replacement
    replica has joined and taken slots from it (requests of a sequence that began before are
    sent back to the replica that holds it)."""
    import os
    import signal

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    http = httpclient.InferenceServerClient(server["url"])

    def send(sequence_id: str, value: int, start: bool = False, end: bool = False, module: Any = grpcclient) -> Any:
        inp = module.InferInput("INPUT", [1, 1], "INT32")
        inp.set_data_from_numpy(np.full((1, 1), value, np.int32))
        client = grpc if module is grpcclient else http
        result = client.infer("seq_python", [inp], sequence_id=sequence_id, sequence_start=start, sequence_end=end)
        return int(result.as_numpy("SUM")[0][0]), int(result.as_numpy("PID")[0][0])

    sums: dict[str, int] = {}
    on: dict[str, int] = {}
    k = 0
    while len(on) < 4 or len(set(on.values())) < 2:  # at most 3 at once per replica (it has 4 slots)
        sequence_id, k = f"death-{k}", k + 1
        total, pid = send(sequence_id, k, start=True)
        if sum(p == pid for p in on.values()) >= 3 or len(on) >= 4:
            send(sequence_id, 0, end=True)
            continue
        sums[sequence_id], on[sequence_id] = total, pid
    counts = {pid: sum(p == pid for p in on.values()) for pid in set(on.values())}
    victim = min(counts, key=counts.get)
    os.kill(victim, signal.SIGKILL)
    try:
        for sequence_id, pid in on.items():
            if pid == victim:
                def failed(sequence_id: str = sequence_id) -> bool:
                    with pytest.raises(InferenceServerException) as error:  # never answered with a new sum
                        send(sequence_id, 1)
                    return "must specify the START flag" in str(error.value)
                wait_until(failed, f"sequence {sequence_id} to fail with Triton's error", timeout_s=60)
        survivors = [s for s, pid in on.items() if pid != victim]
        for sequence_id in survivors:
            total, pid = send(sequence_id, 2)
            sums[sequence_id] += 2
            assert (total, pid) == (sums[sequence_id], on[sequence_id])
        # Serve replaces the dead replica; once it serves new sequences, the survivors go on.
        probes = iter(range(10**6))

        def replaced() -> bool:
            try:
                return send(f"probe-{next(probes)}", 0, start=True, end=True)[1] not in on.values()
            except InferenceServerException:  # a slot still routed to the dead replica
                return False

        wait_until(replaced, "the replacement replica to serve new sequences", timeout_s=120, interval_s=0.5)
        for sequence_id in survivors:
            for step, module in ((3, httpclient), (4, grpcclient)):
                total, pid = send(sequence_id, step, end=step == 4, module=module)
                sums[sequence_id] += step
                assert (total, pid) == (sums[sequence_id], on[sequence_id]), sequence_id
    finally:
        grpc.close()
        http.close()


def test_a_decoupled_sequence_model_runs_its_replicas_and_streams_each_sequences_answers(
        server: dict[str, Any]) -> None:
    """``seq_stream`` (decoupled, two replicas) over one gRPC stream (Serve's ingress hands each
    request to either replica): every request of a sequence runs on the replica holding the
    sequence, and both of its responses come back, relayed when another replica received it."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    ids = [f"stream-{k}" for k in range(12)]
    seen: dict[str, list[tuple[int, int]]] = {sequence_id: [] for sequence_id in ids}
    pids: dict[str, set[int]] = {sequence_id: set() for sequence_id in ids}
    try:
        for step in range(3):
            for k, sequence_id in enumerate(ids):
                inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                inp.set_data_from_numpy(np.full((1, 1), k + step, np.int32))
                client.async_stream_infer("seq_stream", [inp], sequence_id=sequence_id, sequence_start=step == 0,
                                          sequence_end=step == 2)
                for _ in range(2):
                    answer = answers.get(timeout=30)
                    if isinstance(answer, Exception):
                        raise answer
                    seen[sequence_id].append((int(answer.as_numpy("SUM")[0][0]), int(answer.as_numpy("PART")[0][0])))
                    pids[sequence_id].add(int(answer.as_numpy("PID")[0][0]))
    finally:
        client.stop_stream()
        client.close()
    for k, sequence_id in enumerate(ids):
        sums = np.cumsum([k + step for step in range(3)]).tolist()
        assert seen[sequence_id] == [(total, part) for total in sums for part in (0, 1)], sequence_id
    assert all(len(replica) == 1 for replica in pids.values()), pids
    assert len(set().union(*pids.values())) == 2, pids
