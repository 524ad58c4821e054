"""The `flowjit` command: every stage of the compiler, observable from the shell.

    flowjit opt in.fj -p canonicalize              # text IR in, passes (verified), text IR out
    flowjit dump model.py:fn --arg f32[256,784] --arg i64[] [--static n=3] [--stage optimized]
    flowjit compile model.py:fn --arg f32[256,784] --arg f32[784,10] -o out/   # out/fn.so, fn.h, fn.json
    flowjit compile model.py:fn --arg f32[256,784] --target cuda -o out/       # the same, running on a GPU

Every mistake a user can make ends in one `flowjit: error: ...` paragraph on stderr and exit
status 1, never a Python traceback. Subcommands live in `_SUBCOMMANDS`; each has an `_add_<name>`
function declaring its arguments and a `_run_<name>` function doing the work.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence

import flowjit
from flowjit.backends import default_target, get_backend
from flowjit.errors import FlowjitError
from flowjit.ir import dtypes as dt

EXIT_USER_ERROR = 1


class UsageError(FlowjitError):
    """A bad command line, file or function: reported as `flowjit: error: ...`, exit status 1."""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but usage mistakes are reported like every other user error (exit 1)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


# --- flowjit opt ---------------------------------------------------------------------------------------


def _add_opt(sub) -> None:
    p = sub.add_parser("opt", help="read text IR, run passes, print text IR", description=_run_opt.__doc__)
    p.add_argument("file", help="text IR file, or '-' for stdin")
    p.add_argument(
        "-p",
        "--passes",
        default="",
        metavar="PASS[,PASS...]",
        help="comma-separated pass names, run in order with the verifier after each (default: none, "
        "which parses, verifies and prints)",
    )


def _run_opt(args) -> int:
    """Read text IR, run the passes in order (verifying after each), print the resulting text IR."""
    from flowjit.ir.parser import parse_module
    from flowjit.ir.printer import print_module
    from flowjit.ir.verifier import verify
    from flowjit.passes.registry import parse_pipeline, run_pipeline
    from flowjit.runtime.devices import devices

    names = parse_pipeline(args.passes)
    text, filename = _read_text(args.file)
    graphs = parse_module(text, filename)
    for graph in graphs:
        verify(graph)
        graph.devices = tuple(d.name for d in devices())  # what `place` may use: the local devices
    graphs = [run_pipeline(graph, names, verify=True) for graph in graphs]
    sys.stdout.write(print_module(graphs))
    return 0


def _read_text(path: str) -> tuple[str, str]:
    if path == "-":
        return sys.stdin.read(), "<stdin>"
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read text IR file '{path}': {_os_reason(e)}") from None


# --- flowjit dump --------------------------------------------------------------------------------------

_ARG_RE = re.compile(r"^\s*([A-Za-z0-9]+)\s*\[([^\]]*)\]\s*$")
_DTYPE_NAMES = ", ".join(d.name for d in dt.ALL_DTYPES)


def parse_arg_spec(spec: str) -> flowjit.ShapeDtype:
    """`f32[256,784]` -> ShapeDtype((256, 784), float32); `i64[]` is a scalar."""
    m = _ARG_RE.match(spec)
    expected = f"DTYPE[D0,D1,...] with DTYPE one of {_DTYPE_NAMES} and non-negative integer dims (f32[] is a scalar)"
    if m is None:
        raise UsageError(f"--arg '{spec}': expected {expected}")
    name, dims_text = m.groups()
    dtype = next((d for d in dt.ALL_DTYPES if d.name == name), None)
    if dtype is None:
        raise UsageError(f"--arg '{spec}': unknown dtype '{name}'; expected one of {_DTYPE_NAMES}")
    dims = [d.strip() for d in dims_text.split(",")] if dims_text.strip() else []
    if not all(d.isdigit() for d in dims):
        raise UsageError(f"--arg '{spec}': dimensions must be non-negative integers; found [{dims_text}]")
    return flowjit.ShapeDtype(tuple(int(d) for d in dims), dtype.name)


def parse_static(spec: str) -> tuple[str, object]:
    """`n=3` -> ('n', 3); the value is a Python literal (`ast.literal_eval`)."""
    name, sep, value = spec.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise UsageError(f"--static '{spec}': expected NAME=VALUE with a Python literal VALUE (e.g. n=3, mode='sum')")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise UsageError(
            f"--static '{spec}': the value {value.strip()!r} is not a Python literal (a number, string, tuple, "
            "list, dict, True/False/None); quote strings, e.g. mode=\"'sum'\""
        ) from None


def _add_function_arguments(p) -> None:
    """FILE.py:FUNCTION, --arg and --static: how `dump`, `compile` and `check` name a function and its
    signature."""
    p.add_argument("target", metavar="FILE.py:FUNCTION", help="the Python file and the function in it")
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="DTYPE[DIMS]",
        help=f"an array argument, in order, e.g. f32[256,784] or i64[] (dtypes: {_DTYPE_NAMES})",
    )
    p.add_argument(
        "--static",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a static (compile-time) argument given by name, VALUE a Python literal",
    )


def _add_dump(sub) -> None:
    p = sub.add_parser(
        "dump", help="trace a Python function and print one compilation stage", description=_run_dump.__doc__
    )
    _add_function_arguments(p)
    p.add_argument(
        "--stage",
        default="optimized",
        help="traced, optimized, placement, a backend stage (mlir, llvm, asm, ...; ptx with a cuda target) or all "
        "(default: optimized)",
    )
    p.add_argument(
        "--target",
        dest="backend",
        default=None,
        metavar="TARGET",
        help="the backend to compile with: cpu, interpreter, cuda (PTX for sm_80, no GPU needed), cuda-sm_90, ... "
        "(default: the function's own, else each device's)",
    )


def _run_dump(args) -> int:
    """Trace FUNCTION of FILE.py on abstract arguments and print one stage of its compilation."""
    arg_specs = [parse_arg_spec(s) for s in args.arg]
    statics = dict(parse_static(s) for s in args.static)
    path, fn_name = _split_target(args.target)
    fn = _load_function(path, fn_name)
    positional, keywords = _bind_arguments(fn, fn_name, arg_specs, statics)
    jitted = _jit_with_statics(fn, tuple(statics), args.backend)
    lowered = _trace(path, fn_name, lambda: jitted.lower(*positional, **keywords))
    stages = [args.stage]
    if args.stage not in ("traced", "optimized"):
        # Backend stages exist only once compiled, and which ones depends on the target.
        available = _trace(path, fn_name, lambda: lowered.stages)
        if args.stage != "all" and args.stage not in available:
            raise UsageError(
                f"--stage {args.stage}: expected all or a stage of this compilation ({', '.join(available)}); "
                f"the '{lowered.target or default_target()}' target has no stage '{args.stage}'"
            )
        stages = available if args.stage == "all" else [args.stage]
    texts = []
    for stage in stages:
        text = _trace(path, fn_name, lambda s=stage: lowered.as_text(s))
        # IR stages carry a `// stage:` header; give backend stages one too when several are printed.
        if len(stages) > 1 and not text.startswith("// stage:"):
            text = f"// stage: {stage}\n{text}"
        texts.append(text if text.endswith("\n") else text + "\n")
    sys.stdout.write("\n".join(texts))
    return 0


def _jit_with_statics(fn, static_names: tuple[str, ...], target: str | None = None) -> flowjit.Jitted:
    """`fn` under jit with `static_names` static; a function already under `@jit` keeps its options
    (its target too, unless `target` names one)."""
    if target is not None:
        get_backend(target)  # an unknown target fails here, naming the known ones
    if not isinstance(fn, flowjit.Jitted):
        return flowjit.jit(fn, static_argnames=static_names, target=target)
    return flowjit.jit(
        fn.fun,
        static_argnums=fn.static_argnums,
        static_argnames=tuple(dict.fromkeys(fn.static_argnames + static_names)),
        device=fn.device,
        donate_argnums=fn.donate_argnums,
        target=target or fn.target,
        donate_argnames=fn.donate_argnames,
    )


def _split_target(target: str) -> tuple[str, str]:
    path, sep, fn_name = target.rpartition(":")
    if not sep or not path or not fn_name.isidentifier():
        raise UsageError(f"expected FILE.py:FUNCTION (e.g. model.py:predict); found '{target}'")
    return path, fn_name


def _load_function(path: str, fn_name: str) -> Callable:
    if not os.path.isfile(path):
        raise UsageError(f"cannot read Python file '{path}': no such file")
    module_name = "_flowjit_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered like an imported module (dataclasses and pickling look classes up there); its
    # directory on sys.path so it can import its neighbours, as when run as a script.
    sys.modules[module_name] = module
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise UsageError(f"importing '{path}' failed{_user_frame(e, path)}: {type(e).__name__}: {e}") from None
    finally:
        sys.path.pop(0)
    fn = getattr(module, fn_name, None)
    if fn is None:
        found = sorted(
            n for n, v in vars(module).items() if callable(v) and getattr(v, "__module__", "") == module_name
        )
        listed = ", ".join(found) if found else "none"
        raise UsageError(f"'{path}' has no function '{fn_name}'; functions defined there: {listed}")
    if not callable(fn):
        raise UsageError(f"'{path}:{fn_name}' is a {type(fn).__name__}, not a function")
    return fn


def _bind_arguments(fn, fn_name: str, arg_specs: list, statics: dict) -> tuple[list, dict]:
    """Place the --arg values on the function's non-static parameters in order; statics go by name,
    in their own position when they come before an array argument."""
    fn = fn.fun if isinstance(fn, flowjit.Jitted) else fn
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return list(arg_specs), dict(statics)
    positional, keywords, pending = [], dict(statics), list(arg_specs)
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            positional.extend(pending)
            pending = []
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if p.name in keywords and pending:
                positional.append(keywords.pop(p.name))
            elif p.name not in keywords and pending:
                positional.append(pending.pop(0))
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind is not p.VAR_POSITIONAL}
    unknown = [n for n in statics if n not in names and not accepts_any]
    if unknown:
        raise UsageError(f"--static {unknown[0]}: {fn_name}{inspect.signature(fn)} has no parameter '{unknown[0]}'")
    if pending:
        arrays = [p.name for p in params if p.name not in statics and p.kind is not p.VAR_KEYWORD]
        raise UsageError(
            f"{fn_name}{inspect.signature(fn)} takes {len(arrays)} array argument(s) ({', '.join(arrays)}); "
            f"found {len(arg_specs)} --arg"
        )
    return positional, keywords


def _trace(path: str, fn_name: str, thunk: Callable):
    """Run `thunk` (tracing or compiling the user's function); any failure becomes one error line."""
    try:
        return thunk()
    except FlowjitError as e:
        raise UsageError(f"tracing {path}:{fn_name} failed: {e}") from None
    except Exception as e:
        raise UsageError(
            f"tracing {path}:{fn_name} failed{_user_frame(e, path)}: {type(e).__name__}: {e}. "
            "Set FLOWJIT_FULL_TRACEBACK=1 for the full traceback."
        ) from None


def _user_frame(e: BaseException, path: str) -> str:
    """` at FILE:LINE` of the innermost frame in the user's file, if the error passed through it."""
    if isinstance(e, SyntaxError) and e.lineno is not None:
        return f" at {e.filename}:{e.lineno}"
    target = os.path.abspath(path)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == target]
    return f" at {path}:{frames[-1].lineno}" if frames else ""


def _os_reason(e: Exception) -> str:
    return e.strerror.lower() if isinstance(e, OSError) and e.strerror else str(e)


# --- flowjit compile -----------------------------------------------------------------------------------


def _add_compile(sub) -> None:
    p = sub.add_parser(
        "compile",
        help="compile a Python function into a C library (.so/.a), a header and a manifest",
        description=_run_compile.__doc__,
    )
    _add_function_arguments(p)
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="output folder (created if missing)")
    p.add_argument("--name", help="C name of the entry point and base name of the files (default: FUNCTION)")
    p.add_argument(
        "--target",
        dest="backend",
        default="cpu",
        metavar="TARGET",
        help="cpu (default), or cuda (sm_80) / cuda-sm_90, ...: a library running the GPU code through the CUDA "
        "driver, which it loads at run time (no GPU needed to compile)",
    )
    p.add_argument(
        "--threads",
        default=None,
        choices=("openmp", "serial"),
        help="cpu target: openmp: parallel loops, needs libiomp5.so at run time; serial: libc/libm only "
        "(default: openmp)",
    )
    p.add_argument("--static-lib", action="store_true", help="write a static library NAME.a instead of NAME.so")
    p.add_argument(
        "--freeze-variables",
        action="store_true",
        help="bake the variables the function reads into the code, from --checkpoint (default: they become "
        "extra arguments)",
    )
    p.add_argument("--checkpoint", metavar="FILE", help="fj.save_checkpoint file of a dict variable name -> value")
    p.add_argument(
        "--cpu-devices",
        type=int,
        metavar="N",
        help="trace with N CPU devices (default: $FLOWJIT_CPU_DEVICES, else 1); a function placed on several "
        "becomes one library running every partition",
    )


def _run_compile(args) -> int:
    """Compile FUNCTION of FILE.py for the given arguments into DIR/NAME.so (or .a), DIR/NAME.h and
    DIR/NAME.json: a C library that runs without Python (see docs/aot.md)."""
    from flowjit import aot

    if args.backend not in aot.aot_targets():
        raise UsageError(f"--target {args.backend}: expected one of {', '.join(aot.aot_targets())}")
    cuda = args.backend != "cpu"
    if cuda and (args.threads is not None or args.cpu_devices is not None):
        raise UsageError(f"--target {args.backend}: --threads and --cpu-devices apply to the cpu target only")
    if args.freeze_variables != (args.checkpoint is not None):
        raise UsageError("--freeze-variables and --checkpoint FILE go together: the checkpoint holds the values")
    arg_specs = [parse_arg_spec(s) for s in args.arg]
    statics = dict(parse_static(s) for s in args.static)
    path, fn_name = _split_target(args.target)
    options = aot.AotOptions(args.name or fn_name, args.threads or "openmp", args.static_lib, args.backend)
    frozen = aot.load_frozen_variables(args.checkpoint) if args.checkpoint else None
    _prepare_output_dir(args.output)
    with _cpu_devices(args.cpu_devices):
        fn = _load_function(path, fn_name)
        positional, keywords = _bind_arguments(fn, fn_name, arg_specs, statics)
        jitted = _jit_with_statics(fn, tuple(statics), args.backend if cuda else None)
        lowered = _trace(path, fn_name, lambda: jitted.lower(*positional, **keywords))
        try:
            library = aot.build_library(lowered, args.output, options, args.target, frozen)
        except FlowjitError as e:
            raise UsageError(f"compiling {path}:{fn_name} failed: {e}") from None
    print(f"wrote {library.library}, {library.header}, {library.manifest}")
    return 0


@contextlib.contextmanager
def _cpu_devices(count: int | None):
    """`FLOWJIT_CPU_DEVICES=count` while the model is imported, traced and compiled (it may ask for
    its devices at import time); restored afterwards, as `main` may run inside a longer process."""
    if count is None:
        yield
        return
    if count < 1:
        raise UsageError(f"--cpu-devices {count}: expected a positive number of devices")
    previous = os.environ.get("FLOWJIT_CPU_DEVICES")
    os.environ["FLOWJIT_CPU_DEVICES"] = str(count)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["FLOWJIT_CPU_DEVICES"]
        else:
            os.environ["FLOWJIT_CPU_DEVICES"] = previous


def _prepare_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"-o {path}: cannot create the output folder: {_os_reason(e)}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"-o {path}: the output folder is not writable")


# --- flowjit check -------------------------------------------------------------------------------------


def _add_check(sub) -> None:
    p = sub.add_parser(
        "check",
        help="run every compilation stage of a function against the reference interpreter",
        description=_run_check.__doc__,
    )
    _add_function_arguments(p)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random argument values: floats in [-2, 2), ints in [0, 4) (default: 0)",
    )


def _run_check(args) -> int:
    """Trace FUNCTION of FILE.py, run the traced graph, the graph after each pass and the compiled code
    on random arguments, and compare each with the reference interpreter. Exit 0 when all agree; 1
    naming the first stage (pass or backend) that changes the result, the op and its source line."""
    from flowjit.check import check_lowered, random_arguments
    from flowjit.frontend.lowered import PIPELINE

    arg_specs = [parse_arg_spec(s) for s in args.arg]
    statics = dict(parse_static(s) for s in args.static)
    path, fn_name = _split_target(args.target)
    fn = _load_function(path, fn_name)
    arrays = iter(random_arguments(arg_specs, args.seed))
    positional, keywords = _bind_arguments(fn, fn_name, arg_specs, statics)
    positional = [next(arrays) if isinstance(a, flowjit.ShapeDtype) else a for a in positional]
    lowered = _trace(path, fn_name, lambda: _jit_with_statics(fn, tuple(statics)).lower(*positional, **keywords))
    array_args = [a for a in positional if not isinstance(a, flowjit.Variable)]
    report = _trace(path, fn_name, lambda: check_lowered(lowered, array_args, PIPELINE))
    signature = ", ".join(args.arg)
    sys.stdout.write(report.format(f"flowjit check {args.target}({signature}), seed {args.seed}") + "\n")
    return EXIT_USER_ERROR if report.first_failure is not None else 0


# --- entry point ---------------------------------------------------------------------------------------

# name -> (declare arguments, run). `compile` and `check` join this table when they exist.
_SUBCOMMANDS: dict[str, tuple[Callable, Callable]] = {
    "opt": (_add_opt, _run_opt),
    "dump": (_add_dump, _run_dump),
    "compile": (_add_compile, _run_compile),
    "check": (_add_check, _run_check),
}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the `flowjit` command, one subparser per entry of `_SUBCOMMANDS`."""
    parser = _ArgumentParser(prog="flowjit", description="flowjit: a compiler for ML programs written in Python.")
    parser.add_argument("--version", action="version", version=f"flowjit {flowjit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    sub.required = True
    for add, _ in _SUBCOMMANDS.values():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `flowjit` command; returns the exit status (0, or 1 after a `flowjit: error:` line)."""
    try:
        args = build_parser().parse_args(argv)
        return _SUBCOMMANDS[args.command][1](args)
    except FlowjitError as e:
        if os.environ.get("FLOWJIT_FULL_TRACEBACK"):
            raise
        print(f"flowjit: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:
        # `flowjit dump ... | head`: the reader went away; not an error of ours or the user's.
        sys.stderr.close()
        return 0
