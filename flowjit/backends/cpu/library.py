"""Precompiled libraries of the JIT: functions for run-time shapes, written as MLIR by our own code,
compiled once per machine by the backend's pipelines, which programs call instead of compiling a
kernel for their shapes (a function's first call is mostly compile time).

    matmul_library.py   fj_matmul_{f32,f64}[_bt|_at]: large matrix products
    row_library.py      fj_softmax_*, fj_log_softmax_*, fj_layer_norm*_*, fj_rms_norm*_*: whole row functions
    reduction_library.py    fj_reduce_{sum,max,min}_*: reductions of whole arrays
    transpose_library.py    fj_transpose_narrow_*: (K, N) -> (N, K) for N shorter than a vector

`Library` is what they share: where the object lives, its build, its check, its loading.
The cache folder's (`cache_folder.location()`) `library/<name>-<key>.o`, the key a hash of the
backend's fingerprint (flowjit, MLIR and LLVM versions, the backend's source, the library's writer
included, host CPU and cores; `fingerprint.backend_fingerprint`), followed by its sha256 (a file that
fails it is rebuilt: `cache_folder.sealed`). `make` builds them when it sets up the environment (`python -m
flowjit.backends.cpu.libraries`, a few seconds on two cores); otherwise the first program that calls one
does, once per machine. The cache folder's rule applies (`cache_folder`): an object, or a folder
holding it, that another user owns or could have written is refused with a warning and never
loaded; the process builds the library in memory instead. With `FLOWJIT_CACHE=0` flowjit writes
nothing there: libraries already installed are read (installed code, not a cache of the user's
programs), missing ones are built in memory for the process, each time. A process loads a library
(a few ms) when it links code that calls it (`resolve`, from `toolchain`). AOT libraries (`aot.py`)
must stand alone: they compile inside `disabled()`, and each library's own switch
(`FLOWJIT_MATMUL_LIBRARY=0`, `FLOWJIT_ROW_LIBRARY=0`, `FLOWJIT_REDUCTION_LIBRARY=0`,
`FLOWJIT_TRANSPOSE_LIBRARY=0`) turns it off.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable

from flowjit.backends import cache_folder
from flowjit.backends.cpu import fingerprint, host, toolchain

_local = threading.local()


class disabled:
    """Context manager: code compiled inside calls no library (AOT libraries)."""

    def __enter__(self):
        self.before = getattr(_local, "off", False)
        _local.off = True

    def __exit__(self, *exc):
        _local.off = self.before


def enabled(switch: str) -> bool:
    """False with the environment variable `switch` set to 0, or inside `disabled()`."""
    if getattr(_local, "off", False):
        return False
    return os.environ.get(switch, "1") not in ("0", "false", "off", "")


class Writer:
    """MLIR text of one function: SSA names, indentation, index constants; `entry` puts a definition
    (a constant) at the function's entry, once per text, so that any region may use it. `close`
    closes the region the last `open` (or `chunks`) opened."""

    def __init__(self):
        self.lines: list[str] = []
        self.entries: list[str] = []
        self._defined: dict[str, str] = {}
        # Per region open, innermost last: the text closing it, or (the first line of its body, the
        # core's index) for a `chunks` region, whose body is written twice (`close`).
        self._closings: list[str | tuple[int, str]] = []
        self.count = 0
        self.indent = "    "

    def function(self, symbol: str, args: list[str]) -> str:
        """The text of the function `symbol` taking `args` ("%name: type"): its entry's definitions,
        then the body written."""
        header = f"  func.func @{symbol}({', '.join(args)}) {{"
        return "\n".join([header, *self.entries, *self.lines, "  }"])

    def op(self, text: str) -> str:
        name = f"%v{self.count}"
        self.count += 1
        self.lines.append(f"{self.indent}{name} = {text}")
        return name

    def entry(self, text: str) -> str:
        if text not in self._defined:
            name = self._defined[text] = f"%e{len(self._defined)}"
            self.entries.append(f"    {name} = {text}")
        return self._defined[text]

    def line(self, text: str) -> None:
        self.lines.append(self.indent + text)

    def open(self, text: str) -> None:
        self.line(text + " {")
        self.indent += "  "
        self._closings.append("}")

    def close(self, text: str | None = None) -> None:
        """Close the last region opened, with `text` in place of its closing brace when given (a
        brace and attributes). A `chunks` region's body is written a second time, in the else-region
        of its `scf.if`, for one core: the core's index 0, its chunk everything (MLIR scopes names by
        region, so the copy keeps them)."""
        closing = self._closings.pop()
        self.indent = self.indent[:-2]
        if isinstance(closing, str):
            self.line(text or closing)
            return
        first, t = closing
        body = [line[2:] for line in self.lines[first:]]
        self.line("}")
        self.indent = self.indent[:-2]
        self.line("} else {")
        self.line(f"  {t} = arith.constant 0 : index")
        self.lines += body
        self.line("}")

    def otherwise(self) -> None:
        """Close an `scf.if`'s then-region and open its else-region."""
        self._closings.pop()
        self.indent = self.indent[:-2]
        self.open("} else")

    def if_else(self, condition: str, result_type: str, then, otherwise) -> str:
        """An `scf.if` yielding one value of `result_type`: `then()` writes its then-region and returns
        the value to yield, `otherwise()` its else-region's."""
        result = self.fresh("if")
        self.open(f"{result} = scf.if {condition} -> ({result_type})")
        self.line(f"scf.yield {then()} : {result_type}")
        self.otherwise()
        self.line(f"scf.yield {otherwise()} : {result_type}")
        self.close()
        return result

    def index(self, value: int) -> str:
        return self.op(f"arith.constant {value} : index")

    def arith(self, name: str, a: str, b: str | int) -> str:
        if isinstance(b, int):
            b = self.index(b)
        return self.op(f"arith.{name} {a}, {b} : index")

    def fresh(self, prefix: str = "i") -> str:
        self.count += 1
        return f"%{prefix}{self.count}"

    def chunks(self, count: str, chunk: str) -> tuple[str, str, str]:
        """Opens an `scf.forall` over the function's `%threads` cores when there are several, else
        the same body run once in place (`close`): a fork with one thread left idle (OpenMP's
        parallel region) only adds its cost to a small matrix product. Returns (the core's index,
        the first and the end of its `chunk` of [0, count)) (close it)."""
        t = self.fresh("t")
        several = self.entry(f"arith.cmpi ugt, %threads, {self.entry('arith.constant 1 : index')} : index")
        self.line(f"scf.if {several} {{")
        self.indent += "  "
        self.line(f"scf.forall ({t}) in (%threads) {{")
        self.indent += "  "
        self._closings.append((len(self.lines), t))
        lo = self.op(f"arith.minui {self.arith('muli', t, chunk)}, {count} : index")
        hi = self.op(f"arith.minui {self.arith('addi', lo, chunk)}, {count} : index")
        return t, lo, hi


def emit_call(em, symbol: str, note: str, pointers: list[tuple[str, str, str]], scalars: list[tuple]) -> None:
    """A call of the library function `symbol` in a program being lowered (`em`: its KernelEmitter):
    its declaration into the module, the dump's line `// note`, then each of `pointers` (memref,
    its type, the bare-pointer type it is passed as: `memref<1xT>`) cast to its bare pointer, and
    `scalars` ((value literal, type)) as constants, in the function's argument order."""
    types = [target for _, _, target in pointers] + [ty for _, ty in scalars]
    em.declare(f"  func.func private @{symbol}({', '.join(types)})")
    em.line(f"// {note}")
    args = [
        em.op(f"memref.reinterpret_cast {memref} to offset: [0], sizes: [1], strides: [1] : {ty} to {target}")
        for memref, ty, target in pointers
    ]
    args += [em.op(f"arith.constant {value} : {ty}") for value, ty in scalars]
    em.line(f"func.call @{symbol}({', '.join(args)}) : ({', '.join(types)}) -> ()")


class Library:
    """One precompiled library: `mlir()` writes its module, `symbols()` names its functions.
    `strength_reduction`: LLVM's loop strength reduction in its code generation
    (`toolchain.codegen_options`); `switch`: the environment variable that turns it off."""

    def __init__(
        self,
        name: str,
        mlir: Callable[[], str],
        symbols: Callable[[], list[str]],
        strength_reduction: bool,
        switch: str,
    ):
        self.name = name
        self.switch = switch
        self.mlir = mlir
        self.symbols = symbols
        self.strength_reduction = strength_reduction
        self.loaded: list = []  # its NativeModule once loaded, kept alive for the process

    def enabled(self) -> bool:
        """False with its switch set to 0, or inside `disabled()` (AOT compiles)."""
        return enabled(self.switch)

    def path(self) -> str:
        digest = hashlib.sha256(fingerprint.backend_fingerprint().encode()).hexdigest()
        return os.path.join(cache_folder.location(), "library", f"{self.name}-{digest[:32]}.o")

    def build(self) -> bytes:
        """The object code, compiled now (position independent; LLVM's light pipeline, as the
        specialized kernels' modules get: `compiler.light_pipeline`)."""
        lowered = toolchain.lower_to_llvm_ir(self.mlir())
        return toolchain.emit_object(
            lowered.llvm_ir, f"fj_{self.name}_library", strength_reduction=self.strength_reduction, light=True
        )

    def object_code(self) -> bytes:
        """Read from its file, else built and written there (sealed with its sha256). A damaged file
        is rebuilt; a refused one (`cache_folder.read`) is neither read nor replaced; with the
        cache off, or an unwritable folder, the build is not written."""
        path = self.path()
        data = cache_folder.read(path)
        body = cache_folder.unsealed(data) if data is not None else None
        if body is not None:
            return body
        body = self.build()
        try:
            cache_folder.write(path, cache_folder.sealed(body))
        except OSError:
            pass
        return body

    def load(self) -> None:
        """Load the library into this process (once) and make its functions resolvable by name for
        the code compiled or loaded after."""
        # Under the toolchain's (reentrant) lock, which the build and the load take too: a lock of its
        # own, taken by a thread holding the toolchain's while another built under it, would deadlock.
        with toolchain.lock():
            if self.loaded:
                return
            native = toolchain.load_objects((self.object_code(),), f"fj_{self.name}_library")
            binding = host.llvm()
            for name in self.symbols():
                binding.add_symbol(name, native.address(name))
            self.loaded.append(native)

    def resolve(self, names) -> None:
        """Load the library when code about to be linked calls one of its functions (`names`: the
        code's undefined symbols)."""
        if not self.loaded and not set(names).isdisjoint(self.symbols()):
            self.load()
