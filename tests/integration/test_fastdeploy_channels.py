"""The rest of FastDeploy's ``EngineWorkerQueue`` beyond the task path (issue 26 item 4): every
method and attribute FastDeploy's engine, splitwise connector and cache messager use, with
FastDeploy develop's semantics (read from its ``engine_worker_queue.py``), and the roles:
a cache messager per TP rank (``client_id=rank``) started before the workers, as FastDeploy
does in splitwise mode, never takes a rank and does not disturb the group."""

import struct
import threading
import time

import numpy as np
import pytest
import zmq

from conftest import SPAWN
from fastdeploy_sync.fastdeploy import EngineWorkerQueue
from fastdeploy_sync.testing.fd_loops import batches, check_group, engine_loop, ids_of, loop_worker
from fd_workers import cache_messager, side_channel_probe
from workers import wait_until

RESULT_TIMEOUT_S = 60


BARRIERS = ["finish_request_barrier", "finish_send_cache_barrier", "begin_send_cache_barrier",
            "connect_task_barrier", "connect_task_response_barrier", "cache_info_barrier",
            "finish_add_cache_task_barrier"]


def _in_thread(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args)))
    t.start()
    return t, out


def test_whole_list_with_fastdeploys_semantics(name):
    """Server, engine (client_id=0) and two clients (client_id 0 and 1, as cache messagers)
    in one process; every channel's rules as FastDeploy develop's."""
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=2, name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        engine = EngineWorkerQueue(address=address, num_client=2, client_id=0, name=name)
        c = [EngineWorkerQueue(address=address, num_client=2, client_id=r, name=name)
             for r in range(2)]
        for attr in BARRIERS + ["lock", "available_prefill_instances",
                                "exist_tasks_intra_signal", "read_finish_flag",
                                "connected_client_counter", "worker_process_tp_barrier"]:
            assert getattr(c[1], attr) is not None, attr

        # cache infos: a put waits until every client read (at the start: asked once)
        assert engine.num_cache_infos() == 0
        with pytest.raises(TimeoutError):
            engine.put_cache_info(["x"], timeout=0.1)
        assert c[0].get_cache_info() == [] and c[1].get_cache_info() == []
        engine.put_cache_info(["a", "b"])
        assert engine.num_cache_infos() == 2
        assert c[0].get_cache_info() == ["a", "b"] and c[0].get_cache_info() == []
        assert engine.num_cache_infos() == 2  # c[1] has not read them
        with pytest.raises(TimeoutError):
            engine.put_cache_info(["c"], timeout=0.1)
        assert c[1].get_cache_info() == ["a", "b"]
        assert engine.num_cache_infos() == 0  # the last reader emptied them

        # finished requests: every client reports, the engine gets one round
        assert engine.get_finished_req() == []
        assert c[0].put_finished_req([["r1", "finished"]]) is False
        with pytest.raises(TimeoutError):
            engine.get_finished_req(timeout=0.1)  # waits for every client's report
        assert c[1].put_finished_req([["r1", "error: no space"]]) is True
        with pytest.raises(TimeoutError):
            c[0].put_finished_req([["r2", "finished"]], timeout=0.1)  # round not taken yet
        assert engine.get_finished_req() == [["r1", "error: no space"]]
        assert engine.get_finished_req() == []
        assert c[0].put_finished_req([["r2", "finished"]]) is False

        # finished add-cache tasks: the same rule
        assert engine.get_finished_add_cache_task_req() == []
        assert c[0].put_finished_add_cache_task_req(["r3"]) is False
        assert c[1].put_finished_add_cache_task_req(["r3"]) is True
        assert engine.get_finished_add_cache_task_req() == ["r3"]

        # disaggregated tasks: a queue, drained by a get
        assert engine.disaggregate_queue_empty() and engine.get_disaggregated_tasks() is None
        for item in ("t1", ("t2", 2), {"t": 3}):
            c[0].put_disaggregated_tasks(item)
        assert not engine.disaggregate_queue_empty()
        assert engine.get_disaggregated_tasks() == ["t1", ("t2", 2), {"t": 3}]
        assert engine.disaggregate_queue_empty()

        # RDMA connect tasks: offered to every client, once all read the previous one
        with pytest.raises(TimeoutError):
            engine.put_connect_rdma_task({"id": 1}, timeout=0.1)
        assert c[0].get_connect_rdma_task() == (None, False)
        assert c[1].get_connect_rdma_task() == (None, True)
        engine.put_connect_rdma_task({"id": 1})
        assert c[0].get_connect_rdma_task() == ({"id": 1}, False)
        assert c[1].get_connect_rdma_task() == ({"id": 1}, True)
        assert c[0].get_connect_rdma_task() == (None, True)  # read flags stay set until a put

        # their responses: success only if every client's was
        assert engine.get_connect_rdma_task_response() is None
        assert c[0].put_connect_rdma_task_response({"success": True, "id": 1}) is False
        assert c[1].put_connect_rdma_task_response({"success": False, "id": 1}) is True
        assert engine.get_connect_rdma_task_response() == {"success": False, "id": 1}

        # prefill instances: one queue for the server
        assert engine.get_prefill_instances() == 0
        engine.available_prefill_instances.put(3)
        assert c[1].available_prefill_instances.qsize() == 1
        assert c[1].get_prefill_instances() == 3 and engine.available_prefill_instances.empty()

        # lock: one holder across clients
        assert c[0].lock.acquire() is True and c[1].lock.locked()
        assert c[1].lock.acquire(blocking=False) is False
        assert c[1].lock.acquire(timeout=0.05) is False
        c[0].lock.release()
        with c[1].lock:
            assert c[0].lock.locked()
        with pytest.raises(RuntimeError):
            c[0].lock.release()

        # barriers: num_client parties; a waiter that times out breaks it for everyone
        for attr in BARRIERS:
            assert getattr(c[0], attr).parties == 2
        t, out = _in_thread(c[0].cache_info_barrier.wait, 10)
        index = c[1].cache_info_barrier.wait(10)
        t.join(10)
        assert {index, out["r"]} == {0, 1}
        with pytest.raises(threading.BrokenBarrierError):
            c[0].finish_request_barrier.wait(0.1)
        assert c[1].finish_request_barrier.broken
        c[1].finish_request_barrier.reset()
        assert not c[0].finish_request_barrier.broken

        # none of them took a TP rank: no rank is connected to the task queue
        assert engine.connected_client_counter.get() == 0 == c[1].num_connected_clients()
    finally:
        server.cleanup()


def test_to_tensor_and_to_numpy(monkeypatch):
    """FastDeploy's class methods: with FD_ENABLE_E2W_TENSOR_CONVERT set, numpy multimodal
    inputs become paddle tensors in place, and back."""
    class Task:
        def __init__(self, inputs):
            self.multimodal_inputs = inputs

    task = Task({"images": np.ones((2, 3), np.float32), "text": "hi"})
    monkeypatch.delenv("FD_ENABLE_MAX_PREFILL", raising=False)
    monkeypatch.delenv("FD_ENABLE_E2W_TENSOR_CONVERT", raising=False)
    EngineWorkerQueue.to_tensor(([task], 1))
    assert isinstance(task.multimodal_inputs["images"], np.ndarray)  # switched off
    paddle = pytest.importorskip("paddle")
    monkeypatch.setenv("FD_ENABLE_E2W_TENSOR_CONVERT", "1")
    EngineWorkerQueue.to_tensor(([task, Task(None)], 2))
    assert isinstance(task.multimodal_inputs["images"], paddle.Tensor)
    assert task.multimodal_inputs["text"] == "hi"
    EngineWorkerQueue.to_numpy([([task], 1)])
    assert isinstance(task.multimodal_inputs["images"], np.ndarray)
    assert task.multimodal_inputs["images"].sum() == 6


def test_cache_messagers_beside_a_tp2_group(name, procs, results):
    """A cache messager per TP rank (client_id = rank, built with the workers' arguments)
    starts before the workers, as FastDeploy does in splitwise mode, and runs rounds of
    cache infos, barriers and finished requests against the engine while the engine's
    task path feeds the TP=2 group. Before: the messagers had no side channels
    (AttributeError) and, built first, took the TP ranks (a real worker then failed with
    "another live worker group serves this queue"). After: no rank taken, every batch
    delivered consistently, every round of the side channels exact."""
    tp, n, rounds = 2, 20, 3
    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=tp,
                               name=name)
    try:
        address = ("0.0.0.0", server.get_server_port())
        side = SPAWN.Queue()
        for r in range(tp):
            procs(cache_messager, address, tp, r, side, rounds, name=name)
        for _ in range(tp):
            kind, _, r, payload = side.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "ready", payload
        barrier, signal = SPAWN.Barrier(tp), SPAWN.Value("i", 0)
        for r in range(tp):
            procs(loop_worker, address, "develop", tp, r, 0, barrier, signal, results,
                  name=name, step_ms=1.0)
        engine = EngineWorkerQueue(address=address, num_client=tp, client_id=0, name=name)
        put = batches(0, n)
        errors = []

        def tasks():
            try:
                engine_loop(engine, put, put_timeout=30)
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=tasks)
        thread.start()
        finished = []
        for k in range(rounds):  # the connector's and engine's side of each round
            engine.put_cache_info([{"round": k, "blocks": [k, k + 1]}], timeout=30)
            finished.append(wait_until(lambda: engine.get_finished_req(timeout=30), timeout=30,
                                       interval=0.002, what=f"round {k}: a finished request"))
        reports = {}
        for _ in range(tp):
            kind, _, r, payload = results.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "ok", f"rank {r}:\n{payload}"
            reports[r] = payload
        messagers = {}
        for _ in range(tp):
            kind, _, r, payload = side.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "messager", payload
            messagers[r] = payload
        thread.join(timeout=30)
        assert not errors, errors
    finally:
        server.cleanup()
    check_group(reports, tp, 0, ids_of(put))
    assert finished == [[[f"req{k}", "finished"]] for k in range(rounds)]
    for r in range(tp):
        assert messagers[r]["role"] is None  # never joined the TP group
        assert messagers[r]["infos"] == [[{"round": k, "blocks": [k, k + 1]}]
                                         for k in range(rounds)]
    # exactly one messager completes each round's report
    assert [messagers[0]["all_put"][k] + messagers[1]["all_put"][k] for k in range(rounds)] \
        == [1] * rounds


def test_side_channels_over_tcp_need_the_keys(tmp_path, procs, results):
    """Across nodes the side channels are authenticated like the task path: CURVE with the
    library's keys (the server at port + 4096). A client (a process of its own) with the
    keys is answered; one with another key pair never is, and fails naming the endpoint."""
    from fastdeploy_sync.wire.auth import create_keys

    keys, other = tmp_path / "keys", tmp_path / "other"
    create_keys(keys)
    create_keys(other)
    server = EngineWorkerQueue(address=("127.0.0.1", 0), is_server=True, num_client=1,
                               keys_dir=str(keys))
    try:
        address = ("127.0.0.1", server.get_server_port())
        procs(side_channel_probe, address, str(keys), {"x": 1}, results)
        assert results.get(timeout=RESULT_TIMEOUT_S)[0] == "ok"
        assert server.get_disaggregated_tasks() == [{"x": 1}]
        procs(side_channel_probe, address, str(other), {"x": 2}, results, connect_timeout=1.0)
        kind, _, _, text = results.get(timeout=RESULT_TIMEOUT_S)
        assert kind == "error" and text.startswith("ConnectionError"), text
        assert f"tcp://127.0.0.1:{address[1] + 4096}" in text, text
        assert server.get_disaggregated_tasks() is None
    finally:
        server.cleanup()


def test_side_channels_survive_garbage(name):
    """A peer's bytes (same user: the private ipc directory) that are not a request, of
    another version, or that do not decode never stop the service: it answers the next
    request."""
    from fastdeploy_sync.wire.endpoints import default_endpoint

    server = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True, num_client=1, name=name)
    try:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(default_endpoint(name, 0, "side"))
        header = struct.pack("<4sHhiQQ", b"FDS1", 3, 0, 0, 7, 12345)  # a wrong checksum
        for frames in ([b""], [b"x" * 100], [b"FDS9" + b"\0" * 28, b"y"], [header, b"\x80\x05."],
                       [struct.pack("<4sHhiQQ", b"FDS1", 999, 0, 0, 8, 0), b"z"]):
            sock.send_multipart(frames)
        replies = []
        while sock.poll(500):
            replies.append(sock.recv_multipart())
        assert len(replies) == 1  # the wrong checksum is answered (an error), the rest dropped
        ctx.destroy(linger=0)
        address = ("0.0.0.0", server.get_server_port())
        client = EngineWorkerQueue(address=address, num_client=1, client_id=0, name=name,
                                   role=None, connect_timeout=5)
        assert server.num_cache_infos() == 0
        client.put_disaggregated_tasks("still served")
        assert server.get_disaggregated_tasks() == ["still served"]
    finally:
        server.cleanup()


def test_prefill_decode_layout_on_one_node(name, procs, results):
    """FastDeploy's splitwise layout on one node: a prefill instance (TP=2) and a decode
    instance (TP=1), each with its server, its workers and a cache messager per rank built
    with the workers' arguments. Per request: the prefill engine puts the prefill batch,
    puts the cache info its messagers read (cache_info_barrier among them), collects their
    finished report, then hands the request to the decode instance
    (put_disaggregated_tasks); the decode engine drains them and puts the decode batch.
    Every batch of both instances is delivered consistently, every side-channel round is
    exact, no messager takes a rank."""
    n = 4
    names = {"prefill": name, "decode": name + "-dec"}  # the fixture checks both for leftovers
    tps = {"prefill": 2, "decode": 1}
    servers, addresses, engines, puts = {}, {}, {}, {}
    side = SPAWN.Queue()
    worker_results = {"prefill": results, "decode": SPAWN.Queue()}
    keep = []
    try:
        for inst in ("prefill", "decode"):
            servers[inst] = EngineWorkerQueue(address=("0.0.0.0", 0), is_server=True,
                                              num_client=tps[inst], name=names[inst])
            addresses[inst] = ("0.0.0.0", servers[inst].get_server_port())
            for r in range(tps[inst]):
                procs(cache_messager, addresses[inst], tps[inst], r, side, n,
                      name=names[inst], dp_id=0)
        for _ in range(3):
            assert side.get(timeout=RESULT_TIMEOUT_S)[0] == "ready"
        for inst in ("prefill", "decode"):
            barrier, signal = SPAWN.Barrier(tps[inst]), SPAWN.Value("i", 0)
            keep.append((barrier, signal))
            for r in range(tps[inst]):
                procs(loop_worker, addresses[inst], "develop", tps[inst], r, 0, barrier,
                      signal, worker_results[inst], name=names[inst])
            engines[inst] = EngineWorkerQueue(address=addresses[inst], num_client=tps[inst],
                                              client_id=0, name=names[inst])
            puts[inst] = batches(0, n)
        handed, errors = [], []

        def decode_engine():  # drains the handed-off requests, puts their decode batches
            try:
                got = 0
                deadline = time.monotonic() + 60
                while got < n:
                    assert time.monotonic() < deadline, "decode: requests never arrived"
                    items = engines["decode"].get_disaggregated_tasks() or []
                    for item in items:
                        handed.append(item)
                        engines["decode"].put_tasks(puts["decode"][got], timeout=30)
                        got += 1
                        engines["decode"].put_cache_info([{"decode": item}], timeout=30)
                        wait_until(lambda: engines["decode"].get_finished_req(timeout=30),
                                   timeout=30, interval=0.002,
                                   what=f"decode: the finished report of {item}")
                    time.sleep(0.002)
                engines["decode"].put_tasks("stop", timeout=30)
            except BaseException as exc:  # reported below
                errors.append(exc)

        decode = threading.Thread(target=decode_engine)
        decode.start()
        prefill = engines["prefill"]
        for k in range(n):  # the prefill engine and its connector
            prefill.put_tasks(puts["prefill"][k], timeout=30)
            prefill.put_cache_info([{"prefill": k}], timeout=30)
            report = wait_until(lambda: prefill.get_finished_req(timeout=30), timeout=30,
                                interval=0.002, what=f"request {k}: a finished report")
            assert report == [[f"req{k}", "finished"]]
            engines["decode"].put_disaggregated_tasks(("req", k))  # the connector's hand-off
        prefill.put_tasks("stop", timeout=30)
        decode.join(timeout=90)
        assert not errors, errors
        reports = {"prefill": {}, "decode": {}}
        for inst, ranks in reports.items():
            for _ in range(tps[inst]):
                kind, _, r, payload = worker_results[inst].get(timeout=RESULT_TIMEOUT_S)
                assert kind == "ok", f"{inst} rank {r}:\n{payload}"
                ranks[r] = payload
        messagers = []
        for _ in range(3):
            kind, _, r, payload = side.get(timeout=RESULT_TIMEOUT_S)
            assert kind == "messager", payload
            messagers.append(payload)
    finally:
        for server in servers.values():
            server.cleanup()
    for inst in ("prefill", "decode"):
        check_group(reports[inst], tps[inst], 0, ids_of(puts[inst]))
    assert handed == [("req", k) for k in range(n)]
    assert all(m["role"] is None for m in messagers)
    assert sorted(len(m["infos"]) for m in messagers) == [n, n, n]
