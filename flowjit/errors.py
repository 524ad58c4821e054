"""The errors users see. Every mistake a user can make surfaces as a `FlowjitError` whose message
names the user's `file:line`, the op, what was expected and what was found, and how to fix it."""

from __future__ import annotations


class FlowjitError(Exception):
    """Base class of every error flowjit raises for bad user input or an unsupported program."""


class FlowjitTypeError(FlowjitError, TypeError):
    """Wrong shapes, dtypes or argument kinds (e.g. `(256,784) @ (100,10)`)."""


class FlowjitValueError(FlowjitError, ValueError):
    """A well-typed but invalid value (bad axis, out-of-range attribute, bad spec string)."""


class FlowjitAttributeError(FlowjitError, AttributeError):
    """An attribute traced values do not have (`hasattr` still answers False)."""


class FlowjitMemoryError(FlowjitError, MemoryError):
    """A call's results or workspace do not fit in memory (e.g. `fnp.zeros((2**20, 2**20))`)."""


class TracerControlFlowError(FlowjitTypeError):
    """Python control flow (`if`, `while`, `bool()`, `int()`) on a traced value."""


class CompileError(FlowjitError):
    """The compiler cannot handle this program (e.g. an op with no lowering for a backend)."""


class ShapeError(Exception):
    """Raised by shape/dtype rules; the caller adds the op name and the user's location."""


def op_error(cls: type[FlowjitError], loc, op_name: str, message: str) -> FlowjitError:
    """Build an error `file:line: op 'name': message` of class `cls`."""
    where = f"{loc}: " if loc is not None and str(loc) != "<unknown>" else ""
    return cls(f"{where}op '{op_name}': {message}")
