"""The wire format: encoding, decoding, bounds and checksums, in one process (no socket)."""

import pickle

import numpy as np
import pytest
import xxhash

from fastdeploy_sync.errors import ProtocolError
from fastdeploy_sync.wire import codec


def fastdeploy_batch(count=64, length=512):
    requests = [{"request_id": f"req-{i}", "prompt_token_ids": np.arange(length, dtype=np.int64) + i,
                 "sampling_params": {"temperature": 0.7, "top_p": 0.9}} for i in range(count)]
    return requests, count


def checked_round_trip(obj):
    frames = codec.encode_payload(obj)
    return frames, codec.decode_payload(frames, codec.payload_checksum(frames))


@pytest.mark.parametrize("obj", [
    ([], 0),
    None,
    [1, 2.5, "three", b"four", None, (5,)],
    {"nested": {"deeper": [{"ids": list(range(300))}, ("tuple", frozenset({1}))]}},
    ["x" * 100_000],
], ids=["empty-batch", "none", "list", "nested", "big-string"])
def test_plain_objects_round_trip(obj):
    frames, decoded = checked_round_trip(obj)
    assert len(frames) == 1
    assert decoded == obj


def test_arrays_round_trip_out_of_band_as_read_only_views():
    batch = fastdeploy_batch()
    frames, (requests, bsz) = checked_round_trip(batch)
    assert len(frames) == 3 and bsz == 64
    data = np.frombuffer(frames[2], dtype=np.uint8)
    for sent, got in zip(batch[0], requests):
        np.testing.assert_array_equal(got["prompt_token_ids"], sent["prompt_token_ids"])
        assert got["sampling_params"] == sent["sampling_params"]
        assert not got["prompt_token_ids"].flags.writeable
        assert np.shares_memory(got["prompt_token_ids"], data)  # zero-copy
        with pytest.raises(ValueError, match="read-only"):
            got["prompt_token_ids"][0] = 1


def test_small_and_strided_arrays_travel_in_band():
    obj = {"small": np.arange(10, dtype=np.int64),  # 80 bytes < OOB_MIN_BYTES
           "strided": np.arange(4000, dtype=np.int64)[::2],  # not contiguous: pickled in band
           "big": np.ones((64, 64), dtype=np.float32)}
    frames, decoded = checked_round_trip(obj)
    offsets = np.frombuffer(frames[1], dtype=np.int64)
    assert len(offsets) == 2  # only "big" went out of band
    for key, value in obj.items():
        np.testing.assert_array_equal(decoded[key], value)
        assert decoded[key].dtype == value.dtype


def test_checksum_is_never_zero(monkeypatch):
    class ZeroHash:
        def update(self, _):
            pass

        def intdigest(self):
            return 0

    monkeypatch.setattr(codec.xxhash, "xxh3_64", ZeroHash)
    assert codec.payload_checksum([b"\x80\x05N."]) == 1


def corruptions(frames):
    """(label, frames) for every corruption the checksum must catch."""
    for i, frame in enumerate(frames):
        for pos in (0, len(frame) // 2, len(frame) - 1):
            flipped = bytearray(frame)
            flipped[pos] ^= 0x01
            yield f"flip frame {i} byte {pos}", frames[:i] + [bytes(flipped)] + frames[i + 1:]
        yield f"truncate frame {i}", frames[:i] + [frame[:-1]] + frames[i + 1:]
    yield "swap offsets and data", [frames[0], frames[2], frames[1]]
    yield "swap body and offsets", [frames[1], frames[0], frames[2]]
    # the same bytes in the same order, cut differently: only the lengths tell
    yield "move a byte from body to offsets", [frames[0][:-1], frames[0][-1:] + frames[1], frames[2]]
    yield "move a byte from offsets to data", [frames[0], frames[1][:-1], frames[1][-1:] + frames[2]]


def test_checksum_detects_each_corruption():
    frames = codec.encode_payload(fastdeploy_batch())
    expected = codec.payload_checksum(frames)
    labels = []
    for label, corrupted in corruptions(frames):
        assert codec.payload_checksum(corrupted) != expected, label
        with pytest.raises(ProtocolError):
            codec.decode_payload(corrupted, expected)
        labels.append(label)
    assert len(labels) == 3 * 4 + 4


def test_checksum_mismatch_names_both_values_and_stops_before_unpickling():
    body = codec.encode_payload(Recorder())[0]
    codec.decode_payload([body])
    assert calls_made == ["unpickled"]  # without a checksum the body runs
    calls_made.clear()
    good = codec.payload_checksum([body])
    with pytest.raises(ProtocolError, match=f"expected {good + 1:#018x}.*computed {good:#018x}"):
        codec.decode_payload([body], good + 1)
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        codec.decode_payload([body], 0)  # 0 ("no checksum" on the wire) never matches
    assert calls_made == []  # neither body was unpickled


def test_a_shared_stores_checks_name_the_batch_and_what_they_found():
    """The rule both shared-memory readers check by (``verify_checksum`` over the frames
    the engine hashed, then ``verify_data_hash`` over the arrays' bytes)."""
    frames = codec.encode_payload(fastdeploy_batch())
    covered, data = frames[:2], frames[2]
    check = codec.payload_checksum(covered)
    codec.verify_checksum(covered, check, "ring r: seq 7")  # passes, returns nothing
    with pytest.raises(ProtocolError, match=f"ring r: seq 7: payload checksum mismatch: "
                                            f"expected {check ^ 1:#018x}"):
        codec.verify_checksum(covered, check ^ 1, "ring r: seq 7")
    codec.verify_data_hash(data, 0, "x")  # 0: the engine hashed nothing, nothing checked
    good = xxhash.xxh3_64(data).intdigest() or 1
    codec.verify_data_hash(data, good, "x")
    with pytest.raises(ProtocolError, match=f"shared batch s: its {len(data)} bytes of arrays "
                                            f"hash to {good:#018x}, the engine wrote"):
        codec.verify_data_hash(data, good ^ 1, "shared batch s")


calls_made = []


def _record(what):
    calls_made.append(what)


class Recorder:
    def __reduce__(self):
        return _record, ("unpickled",)


def test_structural_errors_are_protocol_errors(monkeypatch):
    # two out-of-band buffers: the plain arrays' region, and a structured array's own
    body, offsets, data = codec.encode_payload([np.arange(1000),
                                                np.zeros(2000, dtype=[("id", "<i8")])])
    pairs = np.frombuffer(offsets, dtype=np.int64)

    def with_pairs(**changes):
        bad = pairs.copy()
        for index, value in changes.items():
            bad[int(index[1:])] = value
        return [body, bad.tobytes(), data]

    cases = [
        ([], "0 payload frames"),
        ([body, offsets], "2 payload frames"),
        ([body, offsets, data, data], "4 payload frames"),
        ([b"hello"], "not a protocol-5 pickle"),
        ([b""], "not a protocol-5 pickle"),
        ([body[:-1]], "not a protocol-5 pickle"),
        ([body, b"", data], "offsets frame of 0 bytes"),
        ([body, offsets[:-8], data], "offsets frame of 24 bytes"),
        (with_pairs(i0=-64), "outside"),
        (with_pairs(i1=-1), "outside"),
        (with_pairs(i3=len(data)), "outside"),
        (with_pairs(i2=len(data) - 8), "outside"),
        ([body, offsets, data[:-1]], "outside"),
        ([b"\x80\x05\x95garbage."], "does not decode"),
    ]
    for frames, message in cases:
        with pytest.raises(ProtocolError, match=message):
            codec.decode_payload(frames)
    with pytest.raises(ProtocolError) as info:
        codec.decode_payload([b"\x80\x05\x95garbage."])
    assert info.value.__cause__ is not None  # the unpickling error is chained
    monkeypatch.setattr(codec, "MAX_BUFFERS", 1)
    with pytest.raises(ProtocolError, match="lists 2 buffers, more than codec.MAX_BUFFERS"):
        codec.decode_payload([body, offsets, data])
    monkeypatch.setattr(codec, "MAX_DATA_BYTES", len(data) - 1)
    monkeypatch.setattr(codec, "MAX_BUFFERS", 2)
    with pytest.raises(ProtocolError, match="MAX_DATA_BYTES"):
        codec.decode_payload([body, offsets, data])
    monkeypatch.setattr(codec, "MAX_BODY_BYTES", len(body) - 1)
    with pytest.raises(ProtocolError, match="MAX_BODY_BYTES"):
        codec.decode_payload([body, offsets, data])


def test_encode_refuses_what_a_worker_would_reject(monkeypatch):
    monkeypatch.setattr(codec, "MAX_BODY_BYTES", 1000)
    with pytest.raises(ValueError, match="MAX_BODY_BYTES"):
        codec.encode_payload(list(range(1000)))
    monkeypatch.undo()
    monkeypatch.setattr(codec, "MAX_BUFFERS", 63)
    with pytest.raises(ValueError, match="MAX_BUFFERS"):
        codec.encode_payload(fastdeploy_batch())
    monkeypatch.setattr(codec, "MAX_BUFFERS", 64)
    monkeypatch.setattr(codec, "MAX_DATA_BYTES", 64 * 4096 - 1)
    with pytest.raises(ValueError, match="MAX_DATA_BYTES"):
        codec.encode_payload(fastdeploy_batch())
    with pytest.raises(TypeError, match="not picklable"):
        codec.encode_payload(lambda: None)


class _Tagged(np.ndarray):
    """An ndarray subclass: it keeps numpy's own reduction (and its type)."""


@pytest.mark.parametrize("array,out_of_band", [
    (np.arange(4096, dtype=np.int64).reshape(8, 16, 32), True),
    (np.linspace(0, 1, 3000, dtype=np.float32), True),
    (np.arange(2000) % 3 == 0, True),  # bool
    (np.arange(600, dtype=">i4"), True),  # non-native byte order
    (np.zeros(200, dtype=[("id", "<i8"), ("score", "<f4")]), True),  # structured
    (np.arange(300).astype("datetime64[s]"), False),  # no buffer export: numpy's own, in band
    (np.asfortranarray(np.arange(4096, dtype=np.int64).reshape(64, 64)), True),  # numpy's own
    (np.arange(8192, dtype=np.int64)[::2], False),  # strided: numpy's own, in band
    (np.arange(2048, dtype=np.int64).view(_Tagged), False),  # subclass: numpy's own, in band
], ids=["int64-3d", "float32", "bool", "big-endian", "structured", "datetime", "fortran",
        "strided", "subclass"])
def test_arrays_of_every_kind_round_trip_exactly(array, out_of_band):
    frames, got = checked_round_trip(array)
    assert len(frames) == (3 if out_of_band else 1)
    assert type(got) is type(array)
    assert got.dtype == array.dtype and got.shape == array.shape
    np.testing.assert_array_equal(got, array)
    if out_of_band:  # the same memory order (an in-band strided array comes back packed)
        assert got.flags.f_contiguous == array.flags.f_contiguous
        assert got.flags.c_contiguous == array.flags.c_contiguous
        # a read-only view of the received data frame
        assert not got.flags.writeable
        assert np.shares_memory(got, np.frombuffer(frames[2], dtype=np.uint8))


def test_plain_arrays_are_rebuilt_by_one_c_call():
    """A large C-contiguous 1-d ndarray pickles as ``numpy.frombuffer(buffer, dtype)`` (one
    C call to decode), not through numpy's Python-level ``_frombuffer``."""
    body = codec.encode_payload(fastdeploy_batch())[0]
    assert b"frombuffer" in body and b"_frombuffer" not in body
    # an object array cannot travel out of band: numpy's own reduction, in band
    objects = np.array([{"x": 1}, None] * 600, dtype=object)
    frames, decoded = checked_round_trip(objects)
    assert len(frames) == 1 and list(decoded) == list(objects)


def test_an_application_reduction_for_ndarray_is_respected(monkeypatch):
    import copyreg

    def as_list(arr):
        return np.array, (arr.tolist(),)

    monkeypatch.setitem(copyreg.dispatch_table, np.ndarray, as_list)
    frames, decoded = checked_round_trip(np.arange(4096, dtype=np.int64))
    assert len(frames) == 1  # the application's reduction pickles in band
    np.testing.assert_array_equal(decoded, np.arange(4096))
    assert decoded.flags.writeable


def test_a_body_whose_shape_needs_more_than_its_buffer_is_a_protocol_error():
    frames = codec.encode_payload(np.arange(4096, dtype=np.int64).reshape(64, 64))
    # an authenticated sender's body asking for more elements than the buffer holds
    # (the checksum recomputed): numpy refuses, decode raises ProtocolError, nothing crashes
    body = frames[0].replace(b"K@K@\x86", b"K\x80K@\x86")  # shape (64, 64) -> (128, 64)
    assert body != frames[0]
    bad = [body, frames[1], frames[2]]
    with pytest.raises(ProtocolError, match="does not decode"):
        codec.decode_payload(bad, codec.payload_checksum(bad))


class _ObjectsOverBytes:
    """Pickles as the encoder's reconstructors called with a dtype of Python objects over an
    out-of-band buffer of plain int64 (what a buggy authenticated sender could send)."""

    def __init__(self, dtype, ndim):
        self.dtype, self.ndim = np.dtype(dtype), ndim

    def __reduce__(self):
        data = pickle.PickleBuffer(np.arange(4096, dtype=np.int64))
        if self.ndim == 1:
            return np.frombuffer, (data, self.dtype)
        return codec._array, (data, self.dtype, 2048, 0, (64, 32))


@pytest.mark.parametrize("dtype", [object, [("id", "<i8"), ("obj", "O")]],
                         ids=["object", "structured-with-objects"])
@pytest.mark.parametrize("ndim", [1, 2])
def test_an_out_of_band_array_of_python_objects_is_refused(dtype, ndim):
    """Bytes are never read as pointers: the reconstructors refuse an out-of-band array of
    Python objects, and decode raises ProtocolError (numpy.ndarray would build one)."""
    frames = codec.encode_payload(_ObjectsOverBytes(dtype, ndim))
    assert len(frames) == 3  # the buffer did travel out of band
    with pytest.raises(ProtocolError, match="does not decode"):
        codec.decode_payload(frames, codec.payload_checksum(frames))


def test_the_plain_arrays_of_a_batch_travel_as_one_out_of_band_buffer():
    """A 64-request batch's token ids are one out-of-band buffer (the data region), not 64:
    the encoder runs no buffer callback per array and the worker slices no buffer per
    array; each array is a read-only view of the region at its own offset, back to back
    (same dtype: one run, copied by one C loop)."""
    batch = fastdeploy_batch()
    parts = codec.encode_parts(batch)
    assert len(parts.pieces) == 1 and parts.data_size == 64 * 512 * 8
    frames = parts.frames()
    assert np.frombuffer(frames[1], dtype=np.int64).tolist() == [0, 64 * 512 * 8]
    assert frames[0].count(pickle.NEXT_BUFFER) == 1
    requests, _ = codec.decode_payload(frames, codec.payload_checksum(frames))
    data = np.frombuffer(frames[2], dtype=np.int64)
    for i, (sent, got) in enumerate(zip(batch[0], requests)):
        np.testing.assert_array_equal(got["prompt_token_ids"], sent["prompt_token_ids"])
        assert not got["prompt_token_ids"].flags.writeable
        assert np.shares_memory(got["prompt_token_ids"], data[i * 512:(i + 1) * 512])


def test_runs_of_mixed_dtypes_and_other_buffers_lay_out_and_copy_exactly():
    """Arrays of several dtypes, interleaved, n-d, one of them twice, beside buffers that
    keep their own (a structured array, a ``PickleBuffer``): every copy of the data region
    (``frames()``, ``write_data()`` into dirty memory, ``chunks()``) holds the same bytes,
    ``data_hash()`` is their hash, runs start on 64-byte boundaries and every array
    decodes exactly, as a view of the region, aligned for its dtype."""
    ids = np.arange(1000, dtype=np.int64)
    obj = {"ids": ids, "again": ids, "mask": np.arange(3000) % 2 == 0,
           "scores": np.linspace(0, 1, 777, dtype=np.float32).reshape(7, 111),
           "more_ids": np.arange(5000, 5500, dtype=np.int64),
           "half": np.ones(1500, dtype=np.float16),
           "records": np.zeros(300, dtype=[("id", "<i8"), ("score", "<f4")]),
           "raw": pickle.PickleBuffer(bytearray(range(256)) * 8)}
    parts = codec.encode_parts(obj)
    frames = parts.frames()
    data = frames[2]
    assert len(data) == parts.data_size
    dest = bytearray(b"\xff" * (parts.data_size + 64))
    parts.write_data(dest)
    assert bytes(dest[:parts.data_size]) == data  # the gaps are zeroed, not left dirty
    assert parts.data_hash() == (codec.xxhash.xxh3_64(data).intdigest() or 1)
    assert all(start % 64 == 0 for start, _, _ in parts.pieces)
    assert [start for start, _, _ in parts.pieces] == sorted(start for start, _, _ in parts.pieces)
    for start, raw in parts.chunks():
        view = memoryview(raw).cast("B")
        assert data[start:start + view.nbytes] == view.tobytes()
    decoded = codec.decode_payload(frames, codec.payload_checksum(frames))
    region = np.frombuffer(data, dtype=np.uint8)
    for key in ("ids", "again", "mask", "scores", "more_ids", "half", "records"):
        np.testing.assert_array_equal(decoded[key], obj[key])
        assert decoded[key].dtype == obj[key].dtype and decoded[key].shape == obj[key].shape
        assert np.shares_memory(decoded[key], region) and not decoded[key].flags.writeable
        assert decoded[key].flags.aligned
    assert decoded["again"] is decoded["ids"]  # one object, as sent
    assert bytes(decoded["raw"]) == bytes(obj["raw"].raw())


@pytest.mark.parametrize("field", ["count", "offset"])
def test_an_array_reaching_outside_the_region_is_a_protocol_error(field):
    """A body (its checksum recomputed: an authenticated but buggy sender) whose array asks
    for items beyond the data region: numpy refuses, decode raises ProtocolError; nothing
    is read outside the region."""
    frames = codec.encode_payload([np.arange(512, dtype=np.int64), np.arange(512, dtype=np.int64)])
    # the second array: count 512 (BININT2 0x0200), offset 4096 (BININT2 0x1000)
    old = b"M\x00\x02M\x00\x10"
    new = {"count": b"M\x01\x02M\x00\x10", "offset": b"M\x00\x02M\x08\x10"}[field]
    assert frames[0].count(old) == 1
    bad = [frames[0].replace(old, new), frames[1], frames[2]]
    with pytest.raises(ProtocolError, match="does not decode"):
        codec.decode_payload(bad, codec.payload_checksum(bad))
