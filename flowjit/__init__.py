"""flowjit: a compiler for machine-learning programs written in Python.

import flowjit as fj, flowjit.numpy as fnp

@fj.jit
def f(x, w, b):
    return fnp.tanh(x @ w + b).sum(axis=1)
"""

from flowjit import (  # noqa: E402,F401  (libraries written on the API above)
    ir,  # noqa: F401  (registers every op)
    nn,
    optim,
    random,
    scipy,
)
from flowjit.backends.gpu.arrays import DeviceArray  # noqa: F401  (results kept on a GPU)
from flowjit.errors import CompileError, FlowjitError, FlowjitMemoryError, FlowjitTypeError, FlowjitValueError  # noqa: F401
from flowjit.frontend import pytree as tree_util  # noqa: F401  (fj.tree_util.register_pytree_node, ...)
from flowjit.frontend.checkpoint import load_checkpoint, save_checkpoint  # noqa: F401
from flowjit.frontend.control_flow import cond, fori_loop, scan, while_loop  # noqa: F401
from flowjit.frontend.custom_derivatives import custom_jvp, custom_vjp  # noqa: F401
from flowjit.frontend.device_put import device_put, from_dlpack  # noqa: F401
from flowjit.frontend.forward import hessian, jacfwd, jacobian, jacrev, jvp, linearize  # noqa: F401
from flowjit.frontend.grad import grad, stop_gradient, value_and_grad, vjp  # noqa: F401
from flowjit.frontend.jit import Jitted, jit  # noqa: F401
from flowjit.frontend.lowered import Compiled, Lowered  # noqa: F401
from flowjit.frontend.pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: F401
from flowjit.frontend.signature import ShapeDtype  # noqa: F401
from flowjit.frontend.variables import Variable  # noqa: F401
from flowjit.frontend.vmap import vmap  # noqa: F401
from flowjit.runtime.devices import Device, DeviceSpec, device, devices  # noqa: F401
from flowjit.version import __version__  # noqa: F401
