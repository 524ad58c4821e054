"""Runs a GPU launch plan on the CPU, for tests on machines without a GPU.

Each `gpu.func` kernel of the "gpu-mlir" stage is rewritten into a CPU function (its block and
thread ids become arguments; a wrapper loops over the grid and the block), lowered to LLVM with
MLIR and compiled with llvmlite. The plan is replayed by the runtime's own code (`runtime.pack`,
`runtime.replay`, `PackedLaunch.fill`): every launch calls its kernel's wrapper with the packed
parameter values, so buffers, views, offsets, loop variables, grid and block dimensions and the
parameter packing are exercised with real data.

Kernels whose threads cooperate (`gpu.barrier`, `gpu.shuffle`, workgroup memory) run each thread
of a block as an OS thread calling the compiled CPU function through ctypes (which releases the GIL);
a barrier and a shuffle are host callbacks (`_Block`). The threads of a block take turns in a fixed
order: the lowest-numbered thread that can run runs until it waits at a barrier or a shuffle, and a
barrier (a warp's shuffle) releases its threads only when every thread of the block (lane of the
warp) waits there. A missing barrier is therefore caught deterministically: the first warp runs on
and reads workgroup memory the others have not written yet, which starts as NaN bytes before every
block. A thread leaving while others wait, a shuffle whose width is not 32, or a block that is not a
whole number of warps is an error. Workgroup attributions become per-block host buffers passed as
arguments.

What it does not check: the NVPTX code generation and the PTX (ptxas assembles it in
test_gpu_codegen.py), the driver, and concurrency beyond the barriers and shuffles above: kernels
without them run their threads one after another (a wrapper loops over the grid and the block),
which is faithful because such threads share nothing; a data race between threads of a block that
a barrier orders in one schedule but not in another is not found. A kernel module's constant
globals become globals of the CPU module (renamed per kernel module).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading

import numpy as np

from flowjit.backends.gpu import compiler, lower_kernels, runtime
from flowjit.backends.gpu.plan import LaunchPlan
from flowjit.backends.mlir import pipeline

_FUNC = re.compile(r"^    gpu\.func @(\w+)\((.*?)\)(?: workgroup\((.*)\))? kernel(?: attributes \{.*\})? \{$")
_MODULE = re.compile(r"^  gpu\.module @(\w+)")
_GLOBAL = re.compile(r"^\s*(memref\.global .*?)@(\w+)(.*)$")
_IDS = re.compile(r"^\s*(%\w+) = gpu\.(block_id|thread_id)\s+([xyz])$")
_ARG = re.compile(r", (?=%\w+ ?: )")
_DIMS = re.compile(r"^\s*(%\w+) = gpu\.(block_dim|grid_dim)\s+([xyz])$")
_SHUFFLE = re.compile(r"^(\s*)(%\w+), (%\w+) = gpu\.shuffle\s+(xor|down|up|idx) (%\w+), (%\w+), (%\w+) : (\w+)$")
_WORKGROUP = ", #gpu.address_space<workgroup>"
_GPU_OP = re.compile(r"(^\s*|= )gpu\.")
_SHUFFLE_MODES = ("xor", "down", "up", "idx")
# The host callbacks cooperative kernels call (`_Block`), declared in the CPU module.
_CALLBACKS = (
    "  func.func private @fj_emu_barrier(index, index, index)\n"
    "  func.func private @fj_emu_shuffle32(i32, i32, i32, i32, index, index, index) -> i32\n"
    "  func.func private @fj_emu_shuffle64(i64, i32, i32, i32, index, index, index) -> i64\n"
    "  func.func private @fj_emu_shuffle_valid(i32, i32, i32, index, index, index) -> i32"
)
LOWER = (  # vector.load/store: the wide accesses of elementwise kernels (`wide_accesses.py`)
    "builtin.module(lower-affine,convert-scf-to-cf,convert-vector-to-llvm,expand-strided-metadata,lower-affine,"
    "convert-math-to-llvm,"
    "finalize-memref-to-llvm,convert-arith-to-llvm,convert-index-to-llvm,convert-func-to-llvm,"
    "convert-cf-to-llvm,reconcile-unrealized-casts)"
)
_GRID = ("gx", "gy", "gz", "dx", "dy", "dz")


@contextlib.contextmanager
def host_loops():
    """Inside: the GPU lowers reductions the simple way (one thread per result, the loops in the
    generic's own order), so a column sum becomes a serial loop over its rows, on the host, around a
    launch per row. The GPU's lowerings write no such loop otherwise (reductions go in two stages or
    keep their loops innermost), but a plan may hold serial loops around launches, and the tests of
    how plans, the runtime and AOT libraries keep and unroll them compile through this."""
    saved = lower_kernels.partials_per_result, compiler.contiguous_dimension_first
    lower_kernels.partials_per_result = lambda results, extent: 1
    compiler.contiguous_dimension_first = lambda module: None
    try:
        yield
    finally:
        lower_kernels.partials_per_result, compiler.contiguous_dimension_first = saved


def _cpu_functions(gpu_mlir: str) -> tuple[str, dict[str, str], dict[str, list[str]]]:
    """The kernels as CPU functions and the grid wrappers of those whose threads share nothing (MLIR
    text); each such kernel module's wrapper symbol; and for each cooperative kernel module (barriers,
    shuffles, workgroup memory) its thread function's symbol followed by the types of its workgroup
    buffers (`_cooperative_function`)."""
    lines = gpu_mlir.splitlines()
    functions, wrappers, cooperative, module = [], {}, {}, None
    constants: dict[str, dict[str, str]] = {}  # kernel module -> its globals' names in the CPU module
    for line in lines:  # the constants kernels read (after their functions in each gpu.module)
        if m := _MODULE.match(line):
            module = m.group(1)
        elif m := _GLOBAL.match(line):
            renamed = constants.setdefault(module, {})[m.group(2)] = f"{module}__{m.group(2)}"
            functions.append(f"  {m.group(1)}@{renamed}{m.group(3)}")
    i = 0
    while i < len(lines):
        if m := _MODULE.match(lines[i]):
            module = m.group(1)
        m = _FUNC.match(lines[i])
        if m is None:
            i += 1
            continue
        name, args = f"{module}__{m.group(1)}", _ARG.split(m.group(2))
        workgroup = _ARG.split(m.group(3)) if m.group(3) else []
        i += 1
        start = i
        while lines[i] != "    }":
            i += 1
        body = lines[start:i]
        if workgroup or any("gpu.barrier" in line or "gpu.shuffle" in line for line in body):
            text, buffers = _cooperative_function(name, args, workgroup, body, constants.get(module, {}))
            functions.append(text)
            cooperative[module] = [name, *buffers]
            continue
        functions.extend(_function_and_grid(name, args, body, constants.get(module, {})))
        wrappers[module] = f"{name}__grid"
    if cooperative:
        functions.append(_CALLBACKS)
    return "module {\n" + "\n".join(functions) + "\n}", wrappers, cooperative


def _renamed(body: list[str], renames: dict[str, str], constants: dict[str, str]) -> str:
    text = "\n".join(body)
    for old, new in renames.items():
        text = re.sub(re.escape(old) + r"\b", new, text)
    for old, new in constants.items():
        text = re.sub(rf"@{re.escape(old)}\b", f"@{new}", text)
    return text


def _function_and_grid(name: str, args: list[str], lines: list[str], constants: dict[str, str]) -> list[str]:
    """A kernel whose threads share nothing as a CPU function of its block and thread ids, and a
    wrapper running it for every block and thread in turn."""
    body, renames = [], {}
    for line in lines:
        ids = _IDS.match(line)
        if ids:
            renames[ids.group(1)] = f"%fj_{'b' if ids.group(2) == 'block_id' else 't'}{ids.group(3)}"
        elif "gpu." in line and "gpu.return" not in line:
            raise NotImplementedError(f"the emulator cannot run {line.strip()}")
        else:
            body.append(line.replace("gpu.return", "return"))
    text = _renamed(body, renames, constants)
    ids = ", ".join(f"%fj_{k}{a}: index" for k in "bt" for a in "xyz")
    names = [a.split(":")[0] for a in args]
    types = [a.split(": ", 1)[1] for a in args]
    loops, close = [], []
    for var, bound in (("bz", "gz"), ("by", "gy"), ("bx", "gx"), ("tz", "dz"), ("ty", "dy"), ("tx", "dx")):
        loops.append(f"    scf.for %fj_{var} = %c0 to %{bound} step %c1 {{")
        close.append("    }")
    call_args = ", ".join([*names, *(f"%fj_{k}{a}" for k in "bt" for a in "xyz")])
    call_types = ", ".join([*types, *["index"] * 6])
    grid = ", ".join(f"%{g}: index" for g in _GRID)
    return [
        f"  func.func @{name}({', '.join(args)}, {ids}) {{\n{text}\n  }}",
        f"  func.func @{name}__grid({', '.join(args)}, {grid}) {{\n"
        "    %c0 = arith.constant 0 : index\n    %c1 = arith.constant 1 : index\n"
        + "\n".join(loops)
        + f"\n    func.call @{name}({call_args}) : ({call_types}) -> ()\n"
        + "\n".join(close)
        + "\n    return\n  }",
    ]


def _cooperative_function(
    name: str, args: list[str], workgroup: list[str], lines: list[str], constants: dict[str, str]
) -> tuple[str, list[str]]:
    """A kernel whose threads cooperate as the CPU function one thread runs: its parameters, then its
    workgroup buffers (host memory), then block ids, thread ids, grid and block dimensions. Barriers
    and shuffles call the host (`_CALLBACKS`). Returns the text and the workgroup buffers' types."""
    ids = {"block_id": "b", "thread_id": "t", "grid_dim": "g", "block_dim": "d"}
    body, renames = [], {}
    for k, line in enumerate(lines):
        found = _IDS.match(line) or _DIMS.match(line)
        shuffle = _SHUFFLE.match(line)
        tids = "%fj_tx, %fj_ty, %fj_tz"
        if found:
            renames[found.group(1)] = f"%fj_{ids[found.group(2)]}{found.group(3)}"
        elif line.strip() == "gpu.barrier":
            indent = line[: len(line) - len(line.lstrip())]
            body.append(f"{indent}func.call @fj_emu_barrier({tids}) : (index, index, index) -> ()")
        elif shuffle:
            indent, result, valid, mode, value, offset, width, elem = shuffle.groups()
            bits = {"f32": 32, "i32": 32, "f64": 64, "i64": 64}.get(elem)
            if bits is None:
                raise NotImplementedError(f"the emulator cannot shuffle {elem}: {line.strip()}")
            word, raw, got, flag = (f"%fj_{kind}{k}" for kind in ("word", "mode", "got", "valid"))
            floating = elem.startswith("f")
            calls = [f"{raw} = arith.constant {_SHUFFLE_MODES.index(mode)} : i32"]
            if floating:
                calls.append(f"{word} = arith.bitcast {value} : {elem} to i{bits}")
            signature = f"(i{bits}, i32, i32, i32, index, index, index) -> i{bits}"
            shuffled = got if floating else result
            calls.append(
                f"{shuffled} = func.call @fj_emu_shuffle{bits}({word if floating else value}, {offset}, {width}, "
                f"{raw}, {tids}) : {signature}"
            )
            if floating:
                calls.append(f"{result} = arith.bitcast {got} : i{bits} to {elem}")
            calls.append(
                f"{flag} = func.call @fj_emu_shuffle_valid({offset}, {width}, {raw}, {tids}) : "
                "(i32, i32, i32, index, index, index) -> i32"
            )
            calls.append(f"{valid} = arith.trunci {flag} : i32 to i1")
            body.extend(indent + c for c in calls)
        elif _GPU_OP.search(line) and "gpu.return" not in line:
            raise NotImplementedError(f"the emulator cannot run {line.strip()}")
        else:
            body.append(line.replace("gpu.return", "return"))
    text = _renamed(body, renames, constants).replace(_WORKGROUP, "")
    buffers = [a.split(":", 1)[1].strip().replace(_WORKGROUP, "") for a in workgroup]
    params = [*args, *(a.replace(_WORKGROUP, "").replace(" :", ":") for a in workgroup)]
    params += [f"%fj_{k}{a}: index" for k in "btgd" for a in "xyz"]
    return f"  func.func @{name}({', '.join(params)}) {{\n{text}\n  }}", buffers


_MEMREF = re.compile(r"^memref<((?:\d+x)*)(\w+)>$")


def _workgroup_buffer(memref: str) -> tuple[np.ndarray, list]:
    """A host buffer for one block's workgroup memref (static, identity layout) and the values of
    its expanded descriptor (allocated and aligned pointer, offset, sizes, strides)."""
    m = _MEMREF.match(memref)
    if m is None:
        raise NotImplementedError(f"the emulator cannot hold workgroup memory of type {memref}")
    shape = [int(d) for d in m.group(1).split("x") if d]
    itemsize = int(re.sub(r"\D", "", m.group(2)) or 8) // 8
    block = np.full(max(1, int(np.prod(shape)) * itemsize), 0xFF, np.uint8)
    strides = [int(np.prod(shape[k + 1 :])) for k in range(len(shape))]
    return block, [block.ctypes.data, block.ctypes.data, 0, *shape, *strides]


class _Block:
    """The threads of one block taking turns (see the module docstring): each waits on its own
    semaphore; the one running hands over at a barrier, a shuffle or its end to the lowest-numbered
    thread that can run. After the last thread of a block ends, the next block starts on the same
    threads (workgroup buffers refilled with NaN bytes)."""

    def __init__(self, block: tuple[int, int, int], blocks: int, workgroup: list[np.ndarray]):
        self.dims = block
        self.size = block[0] * block[1] * block[2]
        self.blocks_left = blocks
        self.workgroup = workgroup
        self.turn = [threading.Semaphore(0) for _ in range(self.size)]
        self.state = ["ready"] * self.size
        self.words: dict[int, tuple[int, int, int, int]] = {}  # thread -> its shuffle (value, offset, width, mode)
        self.got: dict[int, int] = {}
        self.error: str | None = None

    def linear(self, tx: int, ty: int, tz: int) -> int:
        return tx + self.dims[0] * (ty + self.dims[1] * tz)

    def fail(self, message: str) -> None:
        """Record the first error; from then on nothing waits, so every thread runs to its end."""
        if self.error is None:
            self.error = message
        for t in range(self.size):
            self.turn[t].release()

    def hand_over(self, me: int) -> None:
        """`me` waits (barrier, shuffle, end): run the lowest-numbered thread that can run."""
        following = next((t for t in range(self.size) if self.state[t] == "ready"), None)
        if following is None:
            waiting = {s for s in self.state if s != "done"}
            return self.fail(f"threads wait for ever ({', '.join(sorted(waiting))}) while others have left")
        if following != me:
            self.turn[following].release()
            if self.state[me] != "done":
                self.turn[me].acquire()

    def barrier(self, me: int) -> None:
        if self.error is not None:
            return
        self.state[me] = "barrier"
        if "done" in self.state:
            return self.fail(f"thread {me} waits at a barrier that a thread of its block has left")
        if all(s == "barrier" for s in self.state):
            self.state = ["ready"] * self.size
        self.hand_over(me)

    def shuffle(self, me: int, value: int, offset: int, width: int, mode: int) -> int:
        if self.error is not None:
            return value
        if width != 32 or self.size % 32:
            self.fail(f"the emulator shuffles whole warps of 32 (width {width}, a block of {self.size} threads)")
            return value
        self.state[me], self.words[me] = "shuffle", (value, offset, width, mode)
        warp = range(me - me % 32, me - me % 32 + 32)
        if any(self.state[t] == "done" for t in warp):
            self.fail(f"thread {me} shuffles with a lane of its warp that has left")
            return value
        if all(self.state[t] == "shuffle" for t in warp):
            for t in warp:
                source = _shuffle_source(t % 32, *self.words[t][1:])
                self.got[t] = self.words[warp[0] + source][0] if source is not None else self.words[t][0]
            for t in warp:
                self.state[t] = "ready"
        self.hand_over(me)
        return self.got.pop(me, value)

    def end(self, me: int) -> None:
        self.state[me] = "done"
        if self.error is not None:
            return
        if any(s in ("barrier", "shuffle") for s in self.state):
            return self.fail(f"thread {me} left while others wait at a barrier or a shuffle")
        if all(s == "done" for s in self.state):  # the block is over: the next one starts
            self.blocks_left -= 1
            if self.blocks_left == 0:
                return
            for buffer in self.workgroup:
                buffer.fill(0xFF)
            self.state = ["ready"] * self.size
            self.turn[0].release()
            return
        self.hand_over(me)


def _shuffle_source(lane: int, offset: int, width: int, mode: int) -> int | None:
    """The lane whose value `lane` receives (gpu.shuffle over a warp of `width` lanes), or None
    where it keeps its own (the shuffle's `valid` is false)."""
    source = (lane ^ offset, lane + offset, lane - offset, offset)[mode]
    return source if 0 <= source < width else None


_running = threading.local()  # the `_Block` and linear id of the emulated thread an OS thread runs


def _guarded(callback):
    """A host callback that records an exception as the block's error (ctypes would print it and
    return 0 to the kernel)."""

    def call(*args):
        try:
            return callback(_running.block, *args)
        except Exception as error:  # noqa: BLE001 -- reported by `_call_cooperative`
            _running.block.fail(f"{type(error).__name__}: {error}")
            return 0

    return call


@_guarded
def _barrier(block, tx, ty, tz):
    block.barrier(block.linear(tx, ty, tz))


@_guarded
def _shuffle(block, value, offset, width, mode, tx, ty, tz):
    return block.shuffle(block.linear(tx, ty, tz), value, offset, width, mode)


@_guarded
def _shuffle_valid(block, offset, width, mode, tx, ty, tz):
    return int(_shuffle_source(block.linear(tx, ty, tz) % 32, offset, width, mode) is not None)


_INDEX = ctypes.c_uint64
_CALLBACK_FUNCTIONS = {  # kept alive for as long as the process may call them
    "fj_emu_barrier": ctypes.CFUNCTYPE(None, _INDEX, _INDEX, _INDEX)(_barrier),
    "fj_emu_shuffle32": ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32, *[ctypes.c_int32] * 3, *[_INDEX] * 3)(
        _shuffle
    ),
    "fj_emu_shuffle64": ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, *[ctypes.c_int32] * 3, *[_INDEX] * 3)(
        _shuffle
    ),
    "fj_emu_shuffle_valid": ctypes.CFUNCTYPE(ctypes.c_int32, *[ctypes.c_int32] * 3, *[_INDEX] * 3)(_shuffle_valid),
}


class EmulatedKernels:
    """The kernels of one compiled GPU function, compiled for this CPU."""

    def __init__(self, gpu_mlir: str):
        import llvmlite.binding as llvm

        from flowjit.backends.cpu import toolchain

        text, wrappers, cooperative = _cpu_functions(gpu_mlir)
        with pipeline.lock(), pipeline.mlir_context():
            module = pipeline.parse(text)
            pipeline.run_pipeline(module, LOWER, lambda: text)
            llvm_ir = pipeline.translate(module)
        toolchain.llvm()  # llvmlite initialized as the CPU backend does it
        for symbol, callback in _CALLBACK_FUNCTIONS.items():
            llvm.add_symbol(symbol, ctypes.cast(callback, ctypes.c_void_p).value)
        self._module = llvm.parse_assembly(llvm_ir)
        target = llvm.Target.from_default_triple().create_target_machine()
        self._engine = llvm.create_mcjit_compiler(self._module, target)
        self._engine.finalize_object()
        self._wrappers = {module: self._engine.get_function_address(name) for module, name in wrappers.items()}
        self._cooperative = {
            module: (self._engine.get_function_address(name), buffers)
            for module, (name, *buffers) in cooperative.items()
        }
        self._calls: dict[str, object] = {}

    def launch(self, packed: runtime.PackedLaunch) -> None:
        """Run one packed launch on the CPU (the runtime's `replay` calls it)."""
        launch = packed.launch
        self.call(launch.module, packed.values, launch.grid, launch.block)

    def call(self, module: str, values, grid, block) -> None:
        """Run kernel module `module` with parameter `values` (ctypes scalars of its parameters'
        types) over `grid` blocks of `block` threads."""
        if module in self._cooperative:
            return self._call_cooperative(module, values, tuple(grid), tuple(block))
        call = self._calls.get(module)
        if call is None:
            types = [type(v) for v in values] + [ctypes.c_uint64] * 6
            call = self._calls[module] = ctypes.CFUNCTYPE(None, *types)(self._wrappers[module])
        call(*[v.value for v in values], *grid, *block)

    def _call_cooperative(self, module: str, values, grid: tuple, block: tuple) -> None:
        """Every block in turn, each thread of a block an OS thread (`_Block`)."""
        address, buffers = self._cooperative[module]
        held = [_workgroup_buffer(b) for b in buffers]
        described = [x for _, descriptor in held for x in descriptor]
        call = self._calls.get(module)
        if call is None:
            types = [type(v) for v in values] + [ctypes.c_uint64] * (len(described) + 12)
            call = self._calls[module] = ctypes.CFUNCTYPE(None, *types)(address)
        blocks = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]
        if not blocks:
            return
        state = _Block(block, len(blocks), [buffer for buffer, _ in held])
        arguments = [v.value for v in values] + described

        def thread(me: int) -> None:
            _running.block = state
            tx, ty, tz = me % block[0], me // block[0] % block[1], me // (block[0] * block[1])
            for bx, by, bz in blocks:
                if state.error is None:
                    state.turn[me].acquire()
                if state.error is None:
                    call(*arguments, bx, by, bz, tx, ty, tz, *grid, *block)
                state.end(me)

        threads = [threading.Thread(target=thread, args=(t,), daemon=True) for t in range(state.size)]
        for t in threads:
            t.start()
        state.turn[0].release()
        for t in threads:
            t.join()
        if state.error is not None:
            raise RuntimeError(f"kernel {module} on the emulator: {state.error}")


_HOOK = ctypes.CFUNCTYPE(
    None, ctypes.c_char_p, ctypes.c_char_p, *[ctypes.c_uint] * 6, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
)


def run_launches_of(fake_driver: ctypes.CDLL, executables) -> object:
    """Make the fake driver (tests/fake_cuda) run every launch of `executables` (GpuExecutables
    compiled without cubins) on the CPU, so that their `run` computes real results through the
    whole runtime. Returns the hook, which must be kept alive."""
    by_ptx = {}
    for executable in executables:
        kernels = EmulatedKernels(executable.stages["gpu-mlir"])
        kinds = {launch.module: launch.param_kinds() for launch, _ in executable.plan.launches()}
        for image in executable.kernels:
            by_ptx[image.ptx.encode()] = (kernels, image.name, kinds[image.name])

    def hook(ptx, name, gx, gy, gz, bx, by, bz, params, count):
        kernels, module, kinds = by_ptx[ptx]
        values = [runtime._PARAM_CTYPES[k].from_address(params[i]) for i, k in enumerate(kinds)]
        kernels.call(module, values, (gx, gy, gz), (bx, by, bz))

    callback = _HOOK(hook)
    fake_driver.fake_cuda_set_launch_hook(callback)
    return callback


def run(plan: LaunchPlan, kernels: EmulatedKernels, inputs: list[np.ndarray], outputs: list[tuple]) -> list:
    """Replay `plan` on host buffers: inputs copied in, every launch emulated, outputs copied out
    (`outputs`: (shape, dtype) of each). Buffers start filled with 0xFF bytes (NaN for floats), so
    a result that depends on memory nothing wrote is caught."""
    blocks = [np.full(max(b.nbytes, 1), 0xFF, np.uint8) for b in plan.buffers]
    addresses = [block.ctypes.data for block in blocks]
    inputs_at = {b.index: i for i, b in enumerate(plan.buffers) if b.kind == "input"}
    outputs_at = {b.index: i for i, b in enumerate(plan.buffers) if b.kind == "output"}
    for index, array in enumerate(inputs):
        blocks[inputs_at[index]][: array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    runtime.replay(runtime.pack(plan.steps), addresses, kernels.launch)
    results = []
    for index, (shape, dtype) in enumerate(outputs):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        results.append(blocks[outputs_at[index]][:nbytes].view(dtype).reshape(shape).copy())
    return results
