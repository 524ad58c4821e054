"""Pytrees: nested tuples, lists, dicts and namedtuples (and None) of leaves, flattened to a leaf
list plus a hashable `TreeDef` that rebuilds the structure. Dict keys are sorted, as in JAX, so
`{'b': 1, 'a': 2}` and `{'a': 2, 'b': 1}` flatten alike. Classes registered here are nodes too:

    fj.tree_util.register_pytree_node(Point, lambda p: ((p.x, p.y), None), lambda aux, xy: Point(*xy))

    @fj.tree_util.register_dataclass          # fields with metadata={"static": True} are aux data
    @dataclasses.dataclass
    class Params:
        w: np.ndarray
        b: np.ndarray

A node's children are pytrees; its aux data (hashable, compared by value) is part of the `TreeDef`,
so under `fj.jit` a new aux value traces again. Everything else is a leaf. This module is
`fj.tree_util`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.ir.location import user_location


@dataclass(frozen=True)
class TreeDef:
    """The structure of a pytree: `kind` is 'leaf', 'none', 'tuple', 'list', 'dict', 'namedtuple'
    (then `node_type` is the namedtuple class) or 'custom' (a registered class `node_type`, with
    its flatten function's `aux` data, and `keys` its children's field names when known)."""

    kind: str
    children: tuple[TreeDef, ...] = ()
    keys: tuple = ()
    node_type: type | None = None
    aux: Any = None

    @property
    def num_leaves(self) -> int:
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)

    def __str__(self) -> str:
        if self.kind == "leaf":
            return "*"
        if self.kind == "none":
            return "None"
        inner = [str(c) for c in self.children]
        if self.kind == "dict":
            return "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(self.keys, inner)) + "}"
        if self.kind == "namedtuple" or (self.kind == "custom" and self.keys):
            return f"{self.node_type.__name__}(" + ", ".join(f"{k}={c}" for k, c in zip(self.keys, inner)) + ")"
        if self.kind == "custom":
            return f"{self.node_type.__name__}[" + ", ".join(inner) + "]"
        if self.kind == "tuple":
            return "(" + ", ".join(inner) + (",)" if len(inner) == 1 else ")")
        return "[" + ", ".join(inner) + "]"


LEAF = TreeDef("leaf")


@dataclass(frozen=True)
class _NodeRules:
    """How a registered class flattens: `flatten(node) -> (children, aux)`, `unflatten(aux,
    children) -> node`; `names` are the children's field names (dataclasses), for leaf paths."""

    flatten: Callable
    unflatten: Callable
    names: tuple[str, ...] = ()


_registry: dict[type, _NodeRules] = {}


def register_pytree_node(nodetype: type, flatten_func: Callable, unflatten_func: Callable) -> None:
    """Make instances of `nodetype` pytree nodes: `flatten_func(node) -> (children, aux_data)`
    (children an iterable of pytrees, aux_data hashable) and `unflatten_func(aux_data, children)`."""
    _check_registrable(nodetype)
    _registry[nodetype] = _NodeRules(flatten_func, unflatten_func)


def register_pytree_node_class(cls: type) -> type:
    """Class decorator: `cls` flattens with its `tree_flatten()` method and rebuilds with its
    `tree_unflatten(aux_data, children)` classmethod."""
    for method in ("tree_flatten", "tree_unflatten"):
        if not callable(getattr(cls, method, None)):
            raise FlowjitTypeError(
                f"{user_location()}: register_pytree_node_class: {cls.__name__} has no {method}; define "
                "tree_flatten(self) -> (children, aux_data) and a classmethod tree_unflatten(cls, aux_data, children)"
            )
    register_pytree_node(cls, lambda node: node.tree_flatten(), cls.tree_unflatten)
    return cls


def register_dataclass(nodetype: type | None = None, data_fields=None, meta_fields=None):
    """Register a dataclass as a pytree node: `data_fields` are its children (arrays, traced
    under jit), `meta_fields` its aux data (hashable configuration, static under jit). Without
    them, fields whose metadata has `static=True` (`dataclasses.field(metadata={"static": True})`)
    are meta fields and the others data fields. Usable as a decorator, with or without arguments."""
    if nodetype is None:
        return functools.partial(register_dataclass, data_fields=data_fields, meta_fields=meta_fields)
    if not dataclasses.is_dataclass(nodetype):
        raise FlowjitTypeError(
            f"{user_location()}: register_dataclass: {nodetype.__name__} is not a dataclass; decorate it with "
            "@dataclasses.dataclass first (below this decorator), or use fj.tree_util.register_pytree_node"
        )
    fields = [f for f in dataclasses.fields(nodetype) if f.init]
    if data_fields is None and meta_fields is None:
        meta_fields = [f.name for f in fields if f.metadata.get("static", False)]
        data_fields = [f.name for f in fields if not f.metadata.get("static", False)]
    data, meta = tuple(data_fields or ()), tuple(meta_fields or ())
    missing = {f.name for f in fields} - set(data) - set(meta)
    if missing:
        raise FlowjitValueError(
            f"{user_location()}: register_dataclass({nodetype.__name__}): field(s) {sorted(missing)} are in "
            "neither data_fields nor meta_fields"
        )

    def flatten(node):
        return [getattr(node, f) for f in data], tuple(getattr(node, f) for f in meta)

    def unflatten(aux, children):
        return nodetype(**dict(zip(data, children)), **dict(zip(meta, aux)))

    _check_registrable(nodetype)
    _registry[nodetype] = _NodeRules(flatten, unflatten, data)
    return nodetype


def _check_registrable(nodetype) -> None:
    if not isinstance(nodetype, type):
        raise FlowjitTypeError(f"{user_location()}: pytree registration expects a class; found {nodetype!r}")
    if nodetype in _registry or nodetype in (tuple, list, dict, type(None)):
        raise FlowjitValueError(f"{user_location()}: {nodetype.__name__} is already a pytree node type")


def is_pytree_node(x) -> bool:
    """Whether `x` is an instance of a class registered as a pytree node."""
    return type(x) in _registry


def _flatten_custom(node, rules: _NodeRules) -> tuple[list, Any]:
    children, aux = rules.flatten(node)
    try:
        hash(aux)
    except TypeError:
        raise FlowjitTypeError(
            f"{user_location()}: the pytree flatten function of {type(node).__name__} returned aux data of type "
            f"{type(aux).__name__}, which is not hashable; aux data keys jit's cache by value: return a tuple "
            "(not a list) of hashable values"
        ) from None
    return list(children), aux


def _is_namedtuple(node) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def tree_flatten(tree: Any) -> tuple[list, TreeDef]:
    """Leaves in a fixed order and the structure needed to rebuild the tree."""
    leaves: list = []
    return leaves, _flatten_into(tree, leaves)


# The recursive helpers are module-level functions, not closures: a nested function that calls
# itself is a reference cycle (function -> closure cell -> function) that also holds the leaves, so
# every call's arrays (a jitted function's outputs included) stayed alive until the cyclic garbage
# collector ran, and each call touched fresh memory (page faults: ~15% of an MLP training step).
def _flatten_into(node, leaves: list) -> TreeDef:
    if node is None:
        return TreeDef("none")
    rules = _registry.get(type(node))
    if rules is not None:
        children, aux = _flatten_custom(node, rules)
        defs = tuple(_flatten_into(c, leaves) for c in children)
        return TreeDef("custom", defs, rules.names, type(node), aux)
    if _is_namedtuple(node):
        return TreeDef("namedtuple", tuple(_flatten_into(c, leaves) for c in node), type(node)._fields, type(node))
    if isinstance(node, tuple):
        return TreeDef("tuple", tuple(_flatten_into(c, leaves) for c in node))
    if isinstance(node, list):
        return TreeDef("list", tuple(_flatten_into(c, leaves) for c in node))
    if isinstance(node, dict):
        keys = tuple(sorted(node, key=_key_order))
        return TreeDef("dict", tuple(_flatten_into(node[k], leaves) for k in keys), keys)
    leaves.append(node)
    return LEAF


def _key_order(key):
    return (type(key).__name__, key)


def tree_unflatten(treedef: TreeDef, leaves) -> Any:
    """Rebuild a tree of `treedef`'s structure from `leaves` (exactly `treedef.num_leaves` of them)."""
    leaves = list(leaves)
    if len(leaves) != treedef.num_leaves:
        raise FlowjitValueError(f"tree structure {treedef} has {treedef.num_leaves} leaves; found {len(leaves)}")
    return _build(treedef, iter(leaves))


def _build(td: TreeDef, leaves: Iterator) -> Any:
    if td.kind == "leaf":
        return next(leaves)
    if td.kind == "none":
        return None
    children = [_build(c, leaves) for c in td.children]
    if td.kind == "tuple":
        return tuple(children)
    if td.kind == "namedtuple":
        return td.node_type(*children)
    if td.kind == "custom":
        return _registry[td.node_type].unflatten(td.aux, children)
    if td.kind == "list":
        return children
    return dict(zip(td.keys, children))


def tree_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    """Apply `fn` leafwise across trees of the same structure."""
    leaves, treedef = tree_flatten(tree)
    others = []
    for other in rest:
        other_leaves, other_def = tree_flatten(other)
        if other_def != treedef:
            raise FlowjitValueError(f"tree_map: tree structures differ: {treedef} and {other_def}")
        others.append(other_leaves)
    return tree_unflatten(treedef, [fn(*xs) for xs in zip(leaves, *others)])


def tree_structure(tree: Any) -> TreeDef:
    """The `TreeDef` of `tree`."""
    return tree_flatten(tree)[1]


def tree_leaves(tree: Any) -> list:
    """The leaves of `tree`, in flatten order."""
    return tree_flatten(tree)[0]


def leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    """Readable paths of the leaves (`x`, `params['w']`, `batch[0]`, `state.step`) in flatten order."""
    if tree is None:
        return []
    rules = _registry.get(type(tree))
    if rules is not None:
        children, _ = _flatten_custom(tree, rules)
        names = [f".{n}" for n in rules.names] if rules.names else [f"[{i}]" for i in range(len(children))]
        return [p for name, c in zip(names, children) for p in leaf_paths(c, prefix + name)]
    if _is_namedtuple(tree):
        return [p for k, c in zip(type(tree)._fields, tree) for p in leaf_paths(c, f"{prefix}.{k}")]
    if isinstance(tree, (tuple, list)):
        return [p for i, c in enumerate(tree) for p in leaf_paths(c, f"{prefix}[{i}]")]
    if isinstance(tree, dict):
        return [p for k in sorted(tree, key=_key_order) for p in leaf_paths(tree[k], f"{prefix}[{k!r}]")]
    return [prefix]
