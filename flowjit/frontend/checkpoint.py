"""Checkpoints: `fj.save_checkpoint(path, tree)` / `fj.load_checkpoint(path)`.

The tree is a pytree of arrays, scalars and `fj.Variable`s (saved by value). The file is written
atomically (a temporary file in the same directory, fsync, rename), so a crash never leaves a
half-written checkpoint under the real name. Layout:

    b"FLOWJIT-CKPT\\x01" | u64 header length | header (JSON: tree, per-leaf dtype/shape/offset,
    data length, sha256 of the data) | data (leaves' bytes, little-endian, C order)

Loading checks the magic, lengths and checksum: a truncated or corrupted file raises
`FlowjitValueError` naming the file and what is wrong, never loads garbage.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import struct
import tempfile

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.pytree import TreeDef, tree_flatten, tree_unflatten
from flowjit.ir import dtypes as dt
from flowjit.ir.location import user_location

MAGIC = b"FLOWJIT-CKPT\x01"


def _treedef_to_json(td: TreeDef):
    if td.kind == "dict":
        for k in td.keys:
            if not isinstance(k, str | int):
                raise FlowjitTypeError(
                    f"{user_location()}: save_checkpoint: dict keys must be str or int; found {type(k).__name__} "
                    f"{k!r}. Convert the key (e.g. str(key)) before saving"
                )
    node = {"kind": td.kind, "keys": list(td.keys), "children": [_treedef_to_json(c) for c in td.children]}
    if td.kind == "namedtuple":
        node["name"] = td.node_type.__name__
    return node


def _treedef_from_json(obj) -> TreeDef:
    children = tuple(_treedef_from_json(c) for c in obj["children"])
    if obj["kind"] == "namedtuple":
        # The class itself is not stored (no pickle): an equivalent namedtuple with the same name and fields.
        node_type = collections.namedtuple(obj["name"], obj["keys"])
        return TreeDef("namedtuple", children, tuple(obj["keys"]), node_type)
    if obj["kind"] not in ("leaf", "none", "tuple", "list", "dict"):
        raise ValueError(f"unknown tree node kind {obj['kind']!r}")
    return TreeDef(obj["kind"], children, tuple(obj["keys"]))


def _leaf_array(index: int, leaf) -> np.ndarray:
    from flowjit.frontend.trace import Tracer
    from flowjit.frontend.variables import Variable

    if isinstance(leaf, Variable):
        return leaf.numpy()
    if isinstance(leaf, Tracer):
        raise FlowjitTypeError(
            f"{user_location()}: save_checkpoint needs concrete values, not traced ones: call it outside jit"
        )
    array = np.asarray(leaf)
    try:
        dt.dtype(array.dtype)
    except ValueError as e:
        raise FlowjitTypeError(
            f"{user_location()}: save_checkpoint: leaf {index} ({type(leaf).__name__}): {e}"
        ) from None
    return np.array(array, order="C")


def save_checkpoint(path: str | os.PathLike, tree) -> None:
    """Write `tree` to `path` atomically."""
    leaves, treedef = tree_flatten(tree)
    arrays = [_leaf_array(i, leaf) for i, leaf in enumerate(leaves)]
    entries, chunks, offset = [], [], 0
    for a in arrays:
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        entries.append({"dtype": dt.dtype(a.dtype).name, "shape": list(a.shape), "offset": offset, "nbytes": len(data)})
        chunks.append(data)
        offset += len(data)
    blob = b"".join(chunks)
    header = json.dumps(
        {
            "tree": _treedef_to_json(treedef),
            "leaves": entries,
            "data_bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
    ).encode()
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header + blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _corrupt(path, what: str) -> FlowjitValueError:
    return FlowjitValueError(f"checkpoint {path} is corrupt or not a flowjit checkpoint: {what}")


def load_checkpoint(path: str | os.PathLike):
    """Read a checkpoint written by `save_checkpoint`; returns the tree with numpy arrays as leaves."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FlowjitValueError(f"checkpoint {path} does not exist") from None
    except OSError as e:
        raise FlowjitValueError(f"checkpoint {path} cannot be read: {e.strerror or e}") from None
    if not raw.startswith(MAGIC):
        raise _corrupt(path, "bad magic bytes")
    start = len(MAGIC) + 8
    if len(raw) < start:
        raise _corrupt(path, "truncated header")
    (header_len,) = struct.unpack("<Q", raw[len(MAGIC) : start])
    try:
        header = json.loads(raw[start : start + header_len])
        treedef = _treedef_from_json(header["tree"])
        entries, data_bytes, digest = header["leaves"], header["data_bytes"], header["sha256"]
    except (ValueError, KeyError, TypeError):
        raise _corrupt(path, "unreadable header") from None
    blob = raw[start + header_len :]
    if len(blob) != data_bytes:
        raise _corrupt(path, f"expected {data_bytes} bytes of data, found {len(blob)} (truncated?)")
    if hashlib.sha256(blob).hexdigest() != digest:
        raise _corrupt(path, "checksum mismatch")
    try:
        leaves = [_leaf_from_entry(blob, e) for e in entries]
        return tree_unflatten(treedef, leaves)
    except (ValueError, KeyError, TypeError) as e:
        raise _corrupt(path, f"inconsistent header: {e}") from None


def _leaf_from_entry(blob: bytes, entry) -> np.ndarray:
    """One leaf's array, after checking that the header's dtype, shape and byte range agree."""
    np_dtype = dt.dtype(entry["dtype"]).np_dtype
    shape = tuple(int(d) for d in entry["shape"])
    offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
    if min(shape, default=0) < 0 or nbytes != math.prod(shape) * np_dtype.itemsize:
        raise ValueError(f"leaf of shape {shape} and dtype {entry['dtype']} cannot hold {nbytes} bytes")
    if offset < 0 or offset + nbytes > len(blob):
        raise ValueError(f"leaf bytes [{offset}, {offset + nbytes}) lie outside the {len(blob)} data bytes")
    chunk = blob[offset : offset + nbytes]
    return np.frombuffer(chunk, np_dtype.newbyteorder("<")).astype(np_dtype).reshape(shape)
