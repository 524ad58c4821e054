"""fj.save_checkpoint / fj.load_checkpoint: round trips of nested pytrees in every dtype, atomic
writes, and corrupt files that must fail with a FlowjitValueError naming the file."""

import collections
import os

import ml_dtypes
import numpy as np
import pytest

import flowjit as fj
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.pytree import tree_flatten


def every_dtype_tree():
    rng = np.random.default_rng(0)
    return {
        "bool": rng.random((3, 2)) > 0.5,
        "i32": rng.integers(-(2**31), 2**31 - 1, (4,), dtype=np.int32),
        "i64": np.array([-(2**63), 2**63 - 1, 0, 12345678901234], np.int64),
        "f16": rng.standard_normal((2, 3)).astype(np.float16),
        "bf16": rng.standard_normal((5,)).astype(ml_dtypes.bfloat16),
        "f32": np.array([np.inf, -np.inf, np.nan, -0.0, 1e-40], np.float32),
        "f64": rng.standard_normal((2, 2, 2)),
        "nested": [np.float32(1.5), (np.int64(7), {"deep": np.zeros((0, 3), np.float32)})],
        "scalar_f64": np.float64(2.5),
        3: np.arange(6, dtype=np.int32).reshape(2, 3).T,  # int key; a non-contiguous array
        "none": None,
    }


def assert_same_tree(loaded, original):
    loaded_leaves, loaded_def = tree_flatten(loaded)
    original_leaves, original_def = tree_flatten(original)
    assert loaded_def == original_def
    for got, want in zip(loaded_leaves, original_leaves):
        want = np.asarray(want)
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype and got.shape == want.shape
        # Bit-exact, nan payloads and -0.0 included.
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()


def test_round_trip_every_dtype(tmp_path):
    tree = every_dtype_tree()
    path = tmp_path / "all.ckpt"
    fj.save_checkpoint(path, tree)
    assert_same_tree(fj.load_checkpoint(path), tree)
    assert fj.load_checkpoint(str(path)).keys() == tree.keys()


def test_round_trip_python_scalars_lists_tuples(tmp_path):
    tree = ([1, 2.5, True], (np.float32(3.0),), {"empty": [], "t": ()})
    fj.save_checkpoint(tmp_path / "s.ckpt", tree)
    loaded = fj.load_checkpoint(tmp_path / "s.ckpt")
    assert isinstance(loaded, tuple) and isinstance(loaded[0], list) and isinstance(loaded[1], tuple)
    assert loaded[2] == {"empty": [], "t": ()}
    assert [x.item() for x in loaded[0]] == [1, 2.5, True]
    assert loaded[1][0].dtype == np.float32


Point = collections.namedtuple("Point", ["x", "y"])


def test_namedtuple_comes_back_with_its_name_and_fields(tmp_path):
    fj.save_checkpoint(tmp_path / "p.ckpt", {"p": Point(np.ones(2), np.int32(4))})
    loaded = fj.load_checkpoint(tmp_path / "p.ckpt")["p"]
    assert type(loaded).__name__ == "Point" and loaded._fields == ("x", "y")
    np.testing.assert_array_equal(loaded.x, [1.0, 1.0])
    assert loaded.y.dtype == np.int32 and int(loaded.y) == 4


def test_variables_are_saved_by_value(tmp_path):
    w = fj.Variable(np.arange(4, dtype=np.float32), name="ckpt_w")
    fj.save_checkpoint(tmp_path / "v.ckpt", {"w": w, "step": np.int64(3)})
    w.assign(np.zeros(4, np.float32))
    loaded = fj.load_checkpoint(tmp_path / "v.ckpt")
    np.testing.assert_array_equal(loaded["w"], np.arange(4, dtype=np.float32))
    assert isinstance(loaded["w"], np.ndarray) and int(loaded["step"]) == 3
    w.assign(loaded["w"])
    np.testing.assert_array_equal(w.numpy(), np.arange(4))


def test_overwrite_replaces_and_leaves_no_temporaries(tmp_path):
    path = tmp_path / "ckpt"
    fj.save_checkpoint(path, {"a": np.ones(3)})
    fj.save_checkpoint(path, {"b": np.zeros(2, np.int32)})
    loaded = fj.load_checkpoint(path)
    assert list(loaded) == ["b"] and loaded["b"].dtype == np.int32
    assert os.listdir(tmp_path) == ["ckpt"]


def test_creates_missing_directories(tmp_path):
    path = tmp_path / "a" / "b" / "c.ckpt"
    fj.save_checkpoint(path, [np.ones(1)])
    np.testing.assert_array_equal(fj.load_checkpoint(path)[0], [1.0])


# --- atomicity ------------------------------------------------------------------------------------------------


def test_failing_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "model.ckpt"
    fj.save_checkpoint(path, {"step": np.int64(1)})
    before = path.read_bytes()

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        fj.save_checkpoint(path, {"step": np.int64(2)})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.ckpt"]  # the temporary file is gone


def test_failing_write_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("io error")))
    with pytest.raises(OSError):
        fj.save_checkpoint(tmp_path / "new.ckpt", [np.ones(2)])
    assert os.listdir(tmp_path) == []


def test_unsupported_leaf_fails_before_touching_the_file(tmp_path):
    path = tmp_path / "model.ckpt"
    fj.save_checkpoint(path, [np.ones(2)])
    before = path.read_bytes()
    with pytest.raises(FlowjitTypeError, match="leaf 1 .*complex64"):
        fj.save_checkpoint(path, [np.ones(2), np.ones(2, np.complex64)])
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["model.ckpt"]


# --- unsupported keys and traced values -------------------------------------------------------------------------


@pytest.mark.parametrize("bad_key", [(1, 2), 1.5, None])
def test_unsupported_dict_keys_are_a_clear_error(tmp_path, bad_key):
    with pytest.raises(FlowjitTypeError, match="keys must be str or int") as info:
        fj.save_checkpoint(tmp_path / "k.ckpt", {bad_key: np.ones(1)})
    assert type(bad_key).__name__ in str(info.value)
    assert not (tmp_path / "k.ckpt").exists()


def test_mixed_str_and_int_keys_round_trip(tmp_path):
    tree = {"a": np.ones(1), 0: np.zeros(1), "0": np.full(1, 2.0)}
    fj.save_checkpoint(tmp_path / "m.ckpt", tree)
    loaded = fj.load_checkpoint(tmp_path / "m.ckpt")
    assert set(loaded) == {"a", 0, "0"}
    np.testing.assert_array_equal(loaded[0], [0.0])
    np.testing.assert_array_equal(loaded["0"], [2.0])


def test_saving_inside_jit_is_an_error(tmp_path):
    @fj.jit(target="interpreter")
    def f(x):
        fj.save_checkpoint(tmp_path / "j.ckpt", {"x": x})
        return x

    with pytest.raises(FlowjitTypeError, match="outside jit"):
        f(np.ones(2))


# --- corrupt files ----------------------------------------------------------------------------------------------


@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / "good.ckpt"
    fj.save_checkpoint(path, {"w": np.arange(64, dtype=np.float32), "b": [np.ones(3, np.int64)]})
    return path


def corruptions(raw: bytes):
    header_end = raw.index(b"}", 21) + 1 if b"}" in raw else len(raw)
    flipped_data = bytearray(raw)
    flipped_data[-5] ^= 0x10
    flipped_header = bytearray(raw)
    flipped_header[30] ^= 0x01
    flipped_length = bytearray(raw)
    flipped_length[14] ^= 0x40
    return {
        "empty": b"",
        "magic only": raw[:13],
        "wrong magic": b"NOT-A-CKPT!!!" + raw[13:],
        "other version": raw[:12] + b"\x02" + raw[13:],
        "truncated header": raw[: header_end - 10],
        "truncated data": raw[:-7],
        "extra bytes": raw + b"\x00",
        "bit flip in data": bytes(flipped_data),
        "bit flip in header": bytes(flipped_header),
        "bit flip in header length": bytes(flipped_length),
        "text file": b"hello world\n" * 4,
    }


@pytest.mark.parametrize("kind", list(corruptions(b"x" * 64)))
def test_corrupt_files_are_a_clear_error(good_file, kind):
    bad = good_file.with_name("bad.ckpt")
    bad.write_bytes(corruptions(good_file.read_bytes())[kind])
    with pytest.raises(FlowjitValueError, match="corrupt|not a flowjit checkpoint") as info:
        fj.load_checkpoint(bad)
    assert str(bad) in str(info.value)


def test_truncation_anywhere_is_detected(good_file):
    raw = good_file.read_bytes()
    bad = good_file.with_name("cut.ckpt")
    for size in range(0, len(raw), 7):
        bad.write_bytes(raw[:size])
        with pytest.raises(FlowjitValueError, match=str(bad)):
            fj.load_checkpoint(bad)


def test_header_that_lies_about_leaves_is_detected(good_file):
    # A well-formed, checksummed file whose header describes more bytes than it holds.
    import hashlib
    import json
    import struct

    raw = good_file.read_bytes()
    (length,) = struct.unpack("<Q", raw[13:21])
    header = json.loads(raw[21 : 21 + length])
    blob = raw[21 + length :]
    header["leaves"][0]["shape"] = [1000]
    header["leaves"][0]["nbytes"] = 4000
    header["sha256"] = hashlib.sha256(blob).hexdigest()
    text = json.dumps(header).encode()
    bad = good_file.with_name("lie.ckpt")
    bad.write_bytes(raw[:13] + struct.pack("<Q", len(text)) + text + blob)
    with pytest.raises(FlowjitValueError, match=str(bad)):
        fj.load_checkpoint(bad)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FlowjitValueError, match="does not exist"):
        fj.load_checkpoint(tmp_path / "nope.ckpt")
    with pytest.raises(FlowjitValueError, match=str(tmp_path)):
        fj.load_checkpoint(tmp_path)
