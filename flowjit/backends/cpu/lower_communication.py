"""CPU lowering of `send`/`recv`: calls into the step's channel (the runtime's rendezvous) with pointers.

    send %v {key}   ->  flowjit_send(key, &v, nbytes)            (v is copied out, or lent)
    %r = recv {key} ->  flowjit_recv(key, &destination(r), nbytes) (one copy into r's buffer)
    send_done %v... ->  flowjit_send_done()                      (returns once lent buffers were read)

with the C ABI (`communication.py`, pointers passed as 64-bit integers):

    void    flowjit_send(const char *key, const void *data, int64_t nbytes);
    int32_t flowjit_recv(const char *key, void *dest, int64_t nbytes);   // 0: delivered
    void    flowjit_send_done(void);

Keys are NUL-terminated module constants. The step (which rendezvous a key belongs to) is bound
to the calling thread by the runtime before it calls the entry point, so the entry keeps the
`(inputs, outputs, workspace)` signature of every other function. A recv writes straight into the
buffer its value lives in (a workspace slot or an output), so readers see it with no further copy.
Zero-size values carry no data: their send/recv are dropped.
"""

from __future__ import annotations

from flowjit.backends.cpu.target import BUFFER_LOWERINGS
from flowjit.backends.mlir.emitter import memory_elem_type, memref_type, tensor_type
from flowjit.backends.mlir.lowering import bool_to_bytes
from flowjit.ir.graph import Op

SEND_DECL = "  func.func private @flowjit_send(i64, i64, i64)"
RECV_DECL = "  func.func private @flowjit_recv(i64, i64, i64) -> i32"
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


def lower_recv(fl, op: Op) -> None:
    t = op.result.type
    if t.size == 0:
        return
    fl.em.declare(RECV_DECL)
    dest = fl.em.pointer(fl.buffers[op.result], memref_type(t))
    key = _key_pointer(fl, op.attrs["key"])
    fl.em.op(f"func.call @flowjit_recv({key}, {dest}, {_nbytes(fl, t)}) : (i64, i64, i64) -> i32")


def lower_send_done(fl, op: Op) -> None:
    # The sent values are this op's operands, so the workspace plan keeps their slots until here.
    fl.em.declare(SEND_DONE_DECL)
    fl.em.line("func.call @flowjit_send_done() : () -> ()")


BUFFER_LOWERINGS.update({"send": lower_send, "recv": lower_recv, "send_done": lower_send_done})
