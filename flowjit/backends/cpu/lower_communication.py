"""CPU lowering of `send`/`recv`: calls into the step's channel (the runtime's rendezvous) with pointers.

    send %v {key}   ->  flowjit_send(key, &v, nbytes)            (v is copied out, or lent)
    %r = recv {key} ->  flowjit_recv(key, &destination(r), nbytes) (one copy into r's buffer)
    %r = recv {key} ->  r = memref at flowjit_recv_view(key, nbytes) (from another task: no copy)
    send_done %v... ->  flowjit_send_done()                      (returns once lent buffers were read)

with the C ABI (`communication.py`, pointers passed as 64-bit integers):

    void    flowjit_send(const char *key, const void *data, int64_t nbytes);
    int32_t flowjit_recv(const char *key, void *dest, int64_t nbytes);   // 0: delivered
    int64_t flowjit_recv_view(const char *key, int64_t nbytes);          // the value's address
    void    flowjit_send_done(void);

Keys are NUL-terminated module constants. The step (which rendezvous a key belongs to) is bound
to the calling thread by the runtime before it calls the entry point, so the entry keeps the
`(inputs, outputs, workspace)` signature of every other function. A recv writes straight into the
buffer its value lives in (a workspace slot or an output), so readers see it with no further copy.
A value from another task (its send's device in another task: `views_received`) arrives as an
array the runtime holds (from Ray's object store, zero-copy, when large), so unless it is a graph
result (which has an output to fill) its readers read it there: the recv gets no slot, and its
memref is built on the address `flowjit_recv_view` returns (an LLVM descriptor cast to the memref
type, which the LLVM conversion folds away). Nothing writes to it: kernels never write their
operands, and functions with communication take no in-place outputs.
Zero-size values carry no data: their send/recv are dropped.
"""

from __future__ import annotations

from flowjit.backends.cpu.target import BUFFER_LOWERINGS, VIEWS
from flowjit.backends.mlir.emitter import memory_elem_type, memref_type, tensor_type
from flowjit.backends.mlir.lowering import bool_to_bytes
from flowjit.ir.devices import same_task
from flowjit.ir.graph import Op

SEND_DECL = "  func.func private @flowjit_send(i64, i64, i64)"
RECV_DECL = "  func.func private @flowjit_recv(i64, i64, i64) -> i32"
RECV_VIEW_DECL = "  func.func private @flowjit_recv_view(i64, i64) -> i64"
SEND_DONE_DECL = "  func.func private @flowjit_send_done()"


def _key_pointer(fl, key: str) -> str:
    """A pointer to `key` as a NUL-terminated constant of the module."""
    data = key.encode() + b"\0"
    symbol = f"fj_key{sum(1 for g in fl.globals if '@fj_key' in g)}"
    ty = f"memref<{len(data)}xi8>"
    fl.globals.append(
        f'  memref.global "private" constant @{symbol} : {ty} = dense<[{", ".join(str(b) for b in data)}]>'
    )
    return fl.em.pointer(fl.em.op(f"memref.get_global @{symbol} : {ty}"), ty)


def _nbytes(fl, t) -> str:
    return fl.em.op(f"arith.constant {t.nbytes} : i64")


def lower_send(fl, op: Op) -> None:
    (value,) = op.operands
    t = value.type
    if t.size == 0:
        return
    fl.em.declare(SEND_DECL)
    tensor = fl.read(value)
    if t.dtype.is_bool:  # send numpy's bool bytes
        tensor = bool_to_bytes(fl.em, tensor, t)
    ty = memref_type(t)
    buffer = fl.em.op(
        f"bufferization.to_buffer {tensor} read_only : {tensor_type(t, memory_elem_type(t.dtype))} to {ty}"
    )
    data = fl.em.pointer(buffer, ty)
    key = _key_pointer(fl, op.attrs["key"])
    fl.em.line(f"func.call @flowjit_send({key}, {data}, {_nbytes(fl, t)}) : (i64, i64, i64) -> ()")


def views_received(op: Op) -> bool:
    """Whether recv `op` reads its value where the runtime holds it: a value from another task."""
    return not same_task(op.attrs["src"], op.attrs["dst"])


def lower_recv(fl, op: Op) -> None:
    t = op.result.type
    if t.size == 0:
        return
    key = _key_pointer(fl, op.attrs["key"])
    if op.result not in fl.result_outputs and views_received(op):
        fl.em.declare(RECV_VIEW_DECL)
        address = fl.em.op(f"func.call @flowjit_recv_view({key}, {_nbytes(fl, t)}) : (i64, i64) -> i64")
        fl.buffers[op.result] = _memref_at(fl.em, address, t)
        return
    fl.em.declare(RECV_DECL)
    dest = fl.em.pointer(fl.buffers[op.result], memref_type(t))
    fl.em.op(f"func.call @flowjit_recv({key}, {dest}, {_nbytes(fl, t)}) : (i64, i64, i64) -> i32")


def _memref_at(em, address: str, t) -> str:
    """A contiguous memref of type `t` over the memory at `address` (an i64): its LLVM descriptor
    (allocated and aligned pointer, offset 0, sizes, row-major strides) cast to the memref type."""
    shape = t.shape
    arrays = f", array<{len(shape)} x i64>, array<{len(shape)} x i64>" if shape else ""
    struct = f"!llvm.struct<(ptr, ptr, i64{arrays})>"
    pointer = em.op(f"llvm.inttoptr {address} : i64 to !llvm.ptr")
    descriptor = em.op(f"llvm.mlir.undef : {struct}")
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    fields = [([0], pointer), ([1], pointer), ([2], 0)]
    fields += [([3, d], n) for d, n in enumerate(shape)] + [([4, d], n) for d, n in enumerate(strides)]
    for position, value in fields:
        if isinstance(value, int):
            value = em.op(f"llvm.mlir.constant({value} : i64) : i64")
        at = ", ".join(map(str, position))
        descriptor = em.op(f"llvm.insertvalue {value}, {descriptor}[{at}] : {struct}")
    return em.op(f"builtin.unrealized_conversion_cast {descriptor} : {struct} to {memref_type(t)}")


def lower_send_done(fl, op: Op) -> None:
    # The sent values are this op's operands, so the workspace plan keeps their slots until here.
    fl.em.declare(SEND_DONE_DECL)
    fl.em.line("func.call @flowjit_send_done() : () -> ()")


BUFFER_LOWERINGS.update({"send": lower_send, "recv": lower_recv, "send_done": lower_send_done})
VIEWS["recv"] = views_received
