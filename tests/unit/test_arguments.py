"""Arguments refused before anything is made, and codec corner cases a worker relies on."""

import numpy as np
import pytest

from fastdeploy_sync import ProtocolError, TaskClient
from fastdeploy_sync.wire import codec

pytestmark = pytest.mark.usefixtures("loopback_tcp")


def test_malformed_offsets_are_a_protocol_error():
    body, offsets, data = codec.encode_payload([np.arange(1000)])
    bad = np.frombuffer(offsets, dtype=np.int64).copy()
    bad[1] = len(data) + 1  # a buffer running past the data frame
    with pytest.raises(ProtocolError, match="outside"):
        codec.decode_payload([body, bad.tobytes(), data])
    with pytest.raises(ProtocolError, match="payload frames"):
        codec.decode_payload([body, offsets])


def test_small_arrays_stay_in_band():
    frames = codec.encode_payload({"tiny": np.arange(4)})
    assert len(frames) == 1
    np.testing.assert_array_equal(codec.decode_payload(frames)["tiny"], np.arange(4))


@pytest.mark.parametrize("bad", [dict(tp_rank=2), dict(tp_rank=-1), dict(tp_size=0)])
def test_bad_arguments(name, bad):
    kwargs = dict(tp_size=2, tp_rank=0)
    kwargs.update(bad)
    with pytest.raises(ValueError):
        TaskClient(name, kwargs["tp_size"], kwargs["tp_rank"])


def test_unknown_coordinator_is_refused(name, monkeypatch):
    with pytest.raises(ValueError, match="coordinator='nccl'"):
        TaskClient(name, 2, 0, coordinator="nccl")
    monkeypatch.setenv("FD_SYNC_TP_COORDINATOR", "etcd")
    with pytest.raises(ValueError, match="FD_SYNC_TP_COORDINATOR"):
        TaskClient(name, 2, 0)
