"""Names and dp_ids become file names in /dev/shm and the ipc directory: only safe ones pass."""

import pytest

from fastdeploy_sync.wire.endpoints import default_endpoint, MAX_DP_ID, validate_name


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
