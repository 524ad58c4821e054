"""The MLIR half of a compile on several cores: the parts of a split function (`lower_graph(split=n)`)
go through the MLIR pipelines at once, the first in this process and each other one in a forked
child process, which sends back its LLVM IR.

Why: the MLIR pipelines are most of a large function's first call (the MLP training step: over half
of it) and run on one thread: the bindings hold the GIL for a whole pass pipeline, so threads run
them one after the other (two threads on two modules take as much wall time as CPU time).
Processes do not share a GIL. A fork costs a few milliseconds, even in the benchmark suite's
process with JAX's and PyTorch's fork handlers, and copies no memory up front; the child already
has MLIR loaded, its context and its pass managers. Split in two, the training step's first call
is about a fifth shorter on a 2-core AMD EPYC Zen 4 VM.

How: `lower_parts` forks one child per extra part while holding `toolchain.fork_lock`, so no other
thread of this process is inside MLIR or llvmlite when the child's copy of the process is taken; the
child only runs `toolchain.lower_to_llvm_ir` on its text, writes the pickled result (or the error's
text) to a pipe and leaves with `os._exit`, running none of the parent's exit handlers. The parent
lowers the first part meanwhile, then reads each pipe with a deadline (`PART_GRACE_S` plus
`PART_SLACK` times its own part's time); a child that fails or dies fails the compile with its reason
(a crash in MLIR, e.g. an assertion, costs one compile, not the whole process), one that
overruns is stopped and its part lowered here, with a warning. Where no process can be forked (memory or
process limits), the parts left are lowered here, one after the other. `processes()` is 1 (no
split) where there is no `os.fork`, with `FLOWJIT_COMPILE_THREADS=1`, or on one core.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
import warnings

from flowjit.backends.cpu import parallel_codegen, toolchain
from flowjit.errors import CompileError

# The most parts a function is split into: each costs a fork and repeats the function's prologue.
MAX_PARTS = 4
# How long the parent waits for a part's child once its own part is done: PART_GRACE_S plus
# PART_SLACK times what its own part took (the parts are cut to cost about the same). A child still
# running then is stopped and its part lowered here: a child can hang where the parent would not (a
# lock another thread of the parent held when it was forked, held forever in the child's copy).
PART_GRACE_S = 30.0
PART_SLACK = 20.0
# The longest a parent waits for a child in any case (the largest modules compile in seconds).
PART_TIMEOUT_S = 600.0


class _Overrun(Exception):
    """A child did not finish by its deadline (and was stopped)."""


def processes() -> int:
    """How many processes the MLIR half of one function may use (1: it is not split)."""
    if not hasattr(os, "fork") or sys.platform != "linux":
        return 1
    return min(parallel_codegen.threads(), MAX_PARTS)


class _Child:
    """A forked process lowering one part; `result()` collects its `LLVMLowering`."""

    def __init__(self, text: str, index: int, options):
        self.index = index
        read, write = os.pipe()
        with warnings.catch_warnings():
            # Libraries warn at every fork when they run threads (JAX: "will likely lead to a deadlock";
            # Python 3.12+: a DeprecationWarning): the child runs none of their code, only MLIR.
            warnings.simplefilter("ignore", RuntimeWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: lower, report, leave without returning into the caller
            status = 1
            try:
                os.close(read)
                try:
                    payload = ("ok", tuple(toolchain.lower_to_llvm_ir(text, options)))
                except BaseException as e:  # reported to the parent, which raises it
                    payload = ("error", f"{type(e).__name__}: {e}")
                with os.fdopen(write, "wb") as pipe:
                    pipe.write(pickle.dumps(payload))
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        self.pid, self.pipe, self.reaped = pid, read, False

    def result(self, deadline: float) -> toolchain.LLVMLowering:
        chunks = []
        poll = select.poll()  # not select.select: it fails on descriptors past 1023
        poll.register(self.pipe, select.POLLIN | select.POLLHUP)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not poll.poll(left * 1000):
                    self.kill()
                    raise _Overrun()
                chunk = os.read(self.pipe, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(self.pipe)
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:  # already reaped: the program ignores SIGCHLD
            status = None
        self.reaped = True
        if not chunks:
            raise CompileError(
                f"internal error: the process lowering part {self.index + 1} of the function through MLIR "
                f"died ({_exit_reason(status)}); FLOWJIT_COMPILE_THREADS=1 lowers it in this process"
            )
        kind, value = pickle.loads(b"".join(chunks))
        if kind != "ok":
            raise CompileError(f"{value} (part {self.index + 1} of a split function)")
        return toolchain.LLVMLowering(*value)

    def kill(self) -> None:
        """Stop the child unless it was already waited for (its pid may belong to another process)."""
        if self.reaped:
            return
        self.reaped = True
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _exit_reason(status: int | None) -> str:
    if status is None:
        return "its exit status was collected elsewhere"
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _result_or_here(child: _Child, text: str, deadline: float, options) -> toolchain.LLVMLowering:
    """The child's result; if it overran its deadline, the part lowered in this process, with a
    warning: a child can hang where this process would not (a lock held forever in its copy of the
    process). A hang of the pipelines themselves then hangs here, as for a function not split."""
    try:
        return child.result(deadline)
    except _Overrun:
        warnings.warn(
            f"flowjit: the process lowering part {child.index + 1} of a split function through MLIR did not "
            f"finish in time (process {child.pid} stopped); lowering that part in this process instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return toolchain.lower_to_llvm_ir(text, options)


def lower_parts(texts: list[str], options=None, keep_text: bool = False) -> list[toolchain.LLVMLowering]:
    """`toolchain.lower_to_llvm_ir` of each module text with `options` (`pipeline.CompileOptions`),
    the first here and the others in forked processes at the same time (one text: just here)."""
    if len(texts) == 1:
        return [toolchain.lower_to_llvm_ir(texts[0], options, keep_text=keep_text)]
    children: list[_Child] = []
    try:
        with toolchain.fork_lock():
            for k, text in enumerate(texts[1:], start=1):
                try:
                    children.append(_Child(text, k, options))
                except OSError:  # no process to be had (memory, process limits): the rest here
                    break
        start = time.monotonic()
        first = toolchain.lower_to_llvm_ir(texts[0], options, keep_text=keep_text)
        now = time.monotonic()
        deadline = min(now + PART_GRACE_S + PART_SLACK * (now - start), start + PART_TIMEOUT_S)
        rest = [_result_or_here(child, text, deadline, options) for child, text in zip(children, texts[1:])]
        return [first, *rest, *(toolchain.lower_to_llvm_ir(text, options) for text in texts[1 + len(children) :])]
    finally:
        for child in children:  # an error left them running
            child.kill()
