"""Names and dp_ids become file names in /dev/shm and the ipc directory: only safe ones pass."""

import pytest

from fastdeploy_sync.wire.endpoints import MAX_DP_ID, default_endpoint, validate_name


@pytest.mark.parametrize("bad", [
    "llm\n",        # "$" would match before the newline
    "llm\nx",
    "..",
    ".",
    ".x",           # leading dot: hidden file / path component games
    "",
    "a" * 65,
    "a/b",
    "a b",
    "ünï",
    None,
    b"llm",
])
def test_bad_names_are_refused(bad):
    with pytest.raises(ValueError, match="name="):
        validate_name(bad, 0)


@pytest.mark.parametrize("bad", [True, False, 10**70, -1, MAX_DP_ID + 1, 1.0, "0", None])
def test_bad_dp_ids_are_refused(bad):
    with pytest.raises(ValueError, match="dp_id="):
        validate_name("llm", bad)


def test_numpy_int_dp_id_is_refused_with_its_type_named():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="int64"):
        validate_name("llm", np.int64(1))


@pytest.mark.parametrize("good", ["llm", "a", "_x", "x.y-z_1", "A" * 64, "0", "llm..v2"])
def test_good_names_pass(good):
    validate_name(good, 0)
    validate_name(good, MAX_DP_ID)


def test_default_endpoint_validates_before_touching_the_filesystem(tmp_path, monkeypatch):
    monkeypatch.setenv("FD_SYNC_IPC_DIR", str(tmp_path / "ipc"))
    with pytest.raises(ValueError):
        default_endpoint("..", 0)
    assert not (tmp_path / "ipc").exists()
    assert default_endpoint("llm", 3) == f"ipc://{tmp_path}/ipc/fdsync-llm-dp3.ipc"


# -- names.py: every name made and read back in one place ----------------------------------

from fastdeploy_sync import names  # noqa: E402


@pytest.mark.parametrize("name", ["llm", "a.b-c_d", "fdq8000"])
def test_every_shared_memory_name_reads_back_as_what_it_is(name):
    made = {
        names.group_segment(name, 3): ("", None, True),
        names.ack_board(name, 3): (".acks", None, True),
        names.dropin_board(name, 3): (".fd", None, True),
        names.batch_segment(name, 3, 7, pid=42): ("payload", 42, False),
        names.pool(name, 3, 1, pid=42): ("payload", 42, True),
        names.ring(name, 3, 2, pid=42): ("ring", 42, True),
    }
    for shm_name, (kind, pid, locked) in made.items():
        parsed = names.parse_shm_entry(shm_name.lstrip("/"))
        assert (parsed.kind, parsed.name, parsed.dp_id, parsed.pid, parsed.locked) == (
            kind, name, 3, pid, locked), shm_name
        assert not parsed.semaphore
    ring = names.ring(name, 3, 2, pid=42)
    for sem_name, kind, segment in ((names.group_semaphore(name, 3, 1), "semaphore",
                                     names.group_segment(name, 3)),
                                    (names.dropin_board_lock(name, 3), ".fd.lock",
                                     names.dropin_board(name, 3)),
                                    (names.ring_semaphore(ring, 0), "ring semaphore", ring)):
        entry = names.semaphore_path(sem_name)[len(names.SHM_DIR) + 1:]
        parsed = names.parse_shm_entry(entry)
        assert (parsed.kind, parsed.name, parsed.dp_id, parsed.semaphore) == (kind, name, 3, True)
        assert "/" + parsed.segment == segment
    assert names.is_payload_of(ring.lstrip("/"), name, 3)
    assert not names.is_payload_of(ring.lstrip("/"), name + "x", 3)
    assert names.ring_of_semaphore(names.semaphore_path(names.ring_semaphore(ring, 1))
                                   [len(names.SHM_DIR) + 1:]) == ring


def test_socket_files_read_back_and_strangers_do_not():
    for kind, parsed_kind in (("", "socket"), ("put", ".put"), ("side", ".side")):
        parsed = names.parse_socket_entry(names.socket_file("llm.x", 5, kind))
        assert (parsed.kind, parsed.name, parsed.dp_id) == (parsed_kind, "llm.x", 5)
    for stranger in ("fdsync-llm-dpx.ipc", "other.ipc", "fdsync.llm.dp0.bogus", "sem.x"):
        assert names.parse_socket_entry(stranger) is None
        assert names.parse_shm_entry(stranger) is None


def test_a_sealed_memory_servers_socket_reads_back_as_no_queues():
    entry = names.memfd_socket(0x1234)
    assert entry == "fdsync-memfd.0000000000001234.ipc"
    parsed = names.parse_socket_entry(entry)
    assert (parsed.kind, parsed.name) == ("memfd", None) and parsed.kind in names.KINDS
    # a queue named like one is still that queue's socket, and a bad token is nobody's
    queue = names.parse_socket_entry(names.socket_file("memfd.0000000000001234", 0))
    assert (queue.kind, queue.name) == ("socket", "memfd.0000000000001234")
    assert names.parse_socket_entry("fdsync-memfd.1234.ipc") is None
