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

import hashlib
import json
import os
import struct
import tempfile

import numpy as np

from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.pytree import TreeDef, tree_flatten, tree_unflatten
from flowjit.ir import dtypes as dt

MAGIC = b"FLOWJIT-CKPT\x01"


def _treedef_to_json(td: TreeDef):
    if td.kind == "dict":
        for k in td.keys:
            if not isinstance(k, str | int):
                raise FlowjitTypeError(f"checkpoint dict keys must be str or int; found {type(k).__name__} {k!r}")
    return {"kind": td.kind, "keys": list(td.keys), "children": [_treedef_to_json(c) for c in td.children]}


def _treedef_from_json(obj) -> TreeDef:
    return TreeDef(obj["kind"], tuple(_treedef_from_json(c) for c in obj["children"]), tuple(obj["keys"]))


def _leaf_array(leaf) -> np.ndarray:
    from flowjit.frontend.trace import Tracer
    from flowjit.frontend.variables import Variable

    if isinstance(leaf, Variable):
        return leaf.numpy()
    if isinstance(leaf, Tracer):
        raise FlowjitTypeError("save_checkpoint needs concrete values, not traced ones: call it outside jit")
    array = np.asarray(leaf)
    dt.dtype(array.dtype)  # raises a clear error for unsupported dtypes
    return np.array(array, order="C")


def save_checkpoint(path: str | os.PathLike, tree) -> None:
    """Write `tree` to `path` atomically."""
    leaves, treedef = tree_flatten(tree)
    arrays = [_leaf_array(leaf) for leaf in leaves]
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
    leaves = []
    for e in entries:
        np_dtype = dt.dtype(e["dtype"]).np_dtype
        chunk = blob[e["offset"] : e["offset"] + e["nbytes"]]
        leaves.append(np.frombuffer(chunk, np_dtype.newbyteorder("<")).astype(np_dtype).reshape(e["shape"]))
    return tree_unflatten(treedef, leaves)
