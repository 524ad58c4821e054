"""Pytrees: nested tuples, lists, dicts and namedtuples (and None) of leaves, flattened to a leaf
list plus a hashable `TreeDef` that rebuilds the structure. Dict keys are sorted, as in JAX, so
`{'b': 1, 'a': 2}` and `{'a': 2, 'b': 1}` flatten alike. Everything else is a leaf."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from flowjit.errors import FlowjitValueError


@dataclass(frozen=True)
class TreeDef:
    """The structure of a pytree: `kind` is 'leaf', 'none', 'tuple', 'list', 'dict' or 'namedtuple'
    (then `node_type` is the namedtuple class)."""

    kind: str
    children: tuple[TreeDef, ...] = ()
    keys: tuple = ()
    node_type: type | None = None

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
        if self.kind == "namedtuple":
            return f"{self.node_type.__name__}(" + ", ".join(f"{k}={c}" for k, c in zip(self.keys, inner)) + ")"
        if self.kind == "tuple":
            return "(" + ", ".join(inner) + (",)" if len(inner) == 1 else ")")
        return "[" + ", ".join(inner) + "]"


LEAF = TreeDef("leaf")


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


def tree_leaves(tree: Any) -> list:
    """The leaves of `tree`, in flatten order."""
    return tree_flatten(tree)[0]


def leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    """Readable paths of the leaves (`x`, `params['w']`, `batch[0]`, `state.step`) in flatten order."""
    if tree is None:
        return []
    if _is_namedtuple(tree):
        return [p for k, c in zip(type(tree)._fields, tree) for p in leaf_paths(c, f"{prefix}.{k}")]
    if isinstance(tree, (tuple, list)):
        return [p for i, c in enumerate(tree) for p in leaf_paths(c, f"{prefix}[{i}]")]
    if isinstance(tree, dict):
        return [p for k in sorted(tree, key=_key_order) for p in leaf_paths(tree[k], f"{prefix}[{k!r}]")]
    return [prefix]
