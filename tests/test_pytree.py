"""Pytrees: flatten/unflatten round trips, leaf order, paths, and structure equality."""

from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.frontend.pytree import leaf_paths

Point = namedtuple("Point", ["x", "y"])

TREES = [
    1.0,
    None,
    (),
    [],
    {},
    (1, 2),
    (1,),
    [1, [2, (3, None)], {"b": 4, "a": 5}],
    {"w": np.ones(2), "layers": [{"b": 1}, {"b": 2}], "none": None},
    Point(1, (2, 3)),
    {1: "a", 0: "b"},
]


@pytest.mark.parametrize("tree", TREES, ids=repr)
def test_flatten_unflatten_round_trip(tree):
    leaves, treedef = fj.tree_flatten(tree)
    rebuilt = fj.tree_unflatten(treedef, leaves)
    assert repr(rebuilt) == repr(_sorted_dicts(tree))
    assert type(rebuilt) is type(tree)
    assert treedef.num_leaves == len(leaves)
    assert len(leaf_paths(tree)) == len(leaves)


def _sorted_dicts(tree):
    """The tree with dict keys in flatten order (sorted), for comparing reprs."""
    if isinstance(tree, dict):
        return {k: _sorted_dicts(tree[k]) for k in sorted(tree)}
    if isinstance(tree, Point):
        return Point(*(_sorted_dicts(c) for c in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_sorted_dicts(c) for c in tree)
    return tree


def test_dict_keys_are_sorted_so_insertion_order_does_not_matter():
    leaves_ab, def_ab = fj.tree_flatten({"a": 1, "b": 2})
    leaves_ba, def_ba = fj.tree_flatten({"b": 2, "a": 1})
    assert leaves_ab == leaves_ba == [1, 2]
    assert def_ab == def_ba and hash(def_ab) == hash(def_ba)


def test_none_is_a_node_without_leaves_and_structures_compare():
    leaves, treedef = fj.tree_flatten([None, 1, (None,)])
    assert leaves == [1]
    assert str(treedef) == "[None, *, (None,)]"
    assert fj.tree_flatten((1, 2))[1] != fj.tree_flatten([1, 2])[1]
    assert fj.tree_flatten((1, 2))[1] != fj.tree_flatten((1, (2,)))[1]
    assert fj.tree_flatten(Point(1, 2))[1] != fj.tree_flatten((1, 2))[1]


def test_namedtuple_is_rebuilt_as_its_class():
    leaves, treedef = fj.tree_flatten(Point(x=1, y=[2, 3]))
    assert leaves == [1, 2, 3]
    assert str(treedef) == "Point(x=*, y=[*, *])"
    assert fj.tree_unflatten(treedef, [4, 5, 6]) == Point(4, [5, 6])


def test_leaf_paths_are_readable_and_in_flatten_order():
    tree = {"w": [np.ones(1), np.ones(1)], "b": None, "p": Point(1, 2)}
    assert leaf_paths(tree, "params") == ["params['p'].x", "params['p'].y", "params['w'][0]", "params['w'][1]"]


def test_tree_map_over_several_trees():
    out = fj.tree_map(lambda a, b: a + b, {"x": 1, "y": (2, 3)}, {"x": 10, "y": (20, 30)})
    assert out == {"x": 11, "y": (22, 33)}


def test_mismatched_structures_are_a_clear_error():
    with pytest.raises(fj.FlowjitValueError, match=r"tree structures differ: \(\*, \*\) and \[\*, \*\]"):
        fj.tree_map(lambda a, b: a, (1, 2), [1, 2])
    _, treedef = fj.tree_flatten((1, 2))
    with pytest.raises(fj.FlowjitValueError, match="has 2 leaves; found 3"):
        fj.tree_unflatten(treedef, [1, 2, 3])


def _trees(leaves):
    """Nested tuples, lists, string-keyed dicts, namedtuples and None over `leaves`."""
    return st.recursive(
        leaves | st.none(),
        lambda children: (
            st.tuples(children, children).map(lambda c: Point(*c))
            | st.lists(children, max_size=3)
            | st.lists(children, max_size=3).map(tuple)
            | st.dictionaries(st.sampled_from("abcd"), children, max_size=3)
        ),
        max_leaves=8,
    )


@settings(max_examples=40, deadline=None)
@given(_trees(st.integers(-5, 5)))
def test_flatten_unflatten_round_trip_property(tree):
    leaves, treedef = fj.tree_flatten(tree)
    assert fj.tree_unflatten(treedef, leaves) == tree
    assert fj.tree_flatten(fj.tree_unflatten(treedef, leaves))[1] == treedef
    assert fj.tree_map(lambda v: v, tree) == tree


@settings(max_examples=15, deadline=None)
@given(_trees(st.integers(-5, 5).map(lambda v: np.full((2,), v, np.float32))))
def test_jit_returns_any_pytree_it_is_given(tree):
    out = fj.jit(lambda t: fj.tree_map(lambda v: v * 2, t))(tree)
    out_leaves, out_def = fj.tree_flatten(out)
    in_leaves, in_def = fj.tree_flatten(tree)
    assert out_def == in_def
    for a, b in zip(out_leaves, in_leaves):
        np.testing.assert_array_equal(a, b * 2)


def test_flatten_and_unflatten_leave_no_reference_cycle():
    """Leaves are released as soon as the caller drops them, without the cyclic garbage collector: a
    jitted function's outputs kept alive until a collection made every call touch fresh memory."""
    import gc
    import weakref

    class Leaf:
        pass

    f = fj.jit(lambda x: (x + 1.0, {"y": x * 2.0}))
    f(np.ones(4, np.float32))
    gc.disable()
    try:
        leaf = Leaf()
        leaves, treedef = fj.tree_flatten({"a": [leaf, (None, leaf)]})
        rebuilt = fj.tree_unflatten(treedef, leaves)
        ref = weakref.ref(leaf)
        del leaf, leaves, rebuilt
        assert ref() is None
        out = f(np.ones(4, np.float32))
        refs = [weakref.ref(out[0]), weakref.ref(out[1]["y"])]
        del out
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


# --- custom pytree classes (fj.tree_util) ---------------------------------------------------------------


class Box:
    """A class registered with register_pytree_node: two children and a hashable aux (its label)."""

    def __init__(self, a, b, label="box"):
        self.a, self.b, self.label = a, b, label


fj.tree_util.register_pytree_node(Box, lambda box: ((box.a, box.b), box.label), lambda label, ab: Box(*ab, label))


@fj.tree_util.register_pytree_node_class
class Affine:
    def __init__(self, w, b, activation="tanh"):
        self.w, self.b, self.activation = w, b, activation

    def tree_flatten(self):
        return (self.w, self.b), self.activation

    @classmethod
    def tree_unflatten(cls, activation, children):
        return cls(*children, activation)

    def __call__(self, x):
        y = x @ self.w + self.b
        return fnp.tanh(y) if self.activation == "tanh" else y


@fj.tree_util.register_dataclass
@dataclass
class Params:
    w: np.ndarray
    b: np.ndarray
    scale: float = field(default=1.0, metadata={"static": True})


RNG = np.random.default_rng(3)
XS = RNG.standard_normal((5, 3)).astype(np.float32)
WS = RNG.standard_normal((3, 2)).astype(np.float32)
BS = RNG.standard_normal(2).astype(np.float32)


def test_custom_nodes_flatten_and_rebuild_with_their_aux_data():
    leaves, treedef = fj.tree_flatten([Box(1, (2, 3), "x"), Params(4, 5, 2.0)])
    assert leaves == [1, 2, 3, 4, 5]
    rebuilt = fj.tree_unflatten(treedef, [10, 20, 30, 40, 50])
    assert (rebuilt[0].a, rebuilt[0].b, rebuilt[0].label) == (10, (20, 30), "x")
    assert rebuilt[1] == Params(40, 50, 2.0)
    assert fj.tree_util.tree_structure(Box(1, 2, "x")) != fj.tree_util.tree_structure(Box(1, 2, "y"))
    assert str(fj.tree_util.tree_structure(Params(1, 2))) == "Params(w=*, b=*)"
    assert leaf_paths({"p": Params(1, 2), "box": Box(3, 4)}) == ["['box'][0]", "['box'][1]", "['p'].w", "['p'].b"]
    assert fj.tree_map(lambda v: v * 2, Params(1, 2, 3.0)) == Params(2, 4, 3.0)


def test_custom_nodes_are_jit_arguments_and_results_whose_aux_keys_the_cache():
    traces = []

    @fj.jit
    def apply(layer, x):
        traces.append(1)
        return Box(layer(x), x.sum(), layer.activation)

    out = apply(Affine(WS, BS), XS)
    assert isinstance(out, Box) and out.label == "tanh"
    np.testing.assert_allclose(out.a, np.tanh(XS @ WS + BS), rtol=1e-5)
    np.testing.assert_allclose(apply(Affine(2 * WS, BS), XS).a, np.tanh(XS @ (2 * WS) + BS), rtol=1e-5)
    assert len(traces) == 1  # new arrays, same structure: cached
    np.testing.assert_allclose(apply(Affine(WS, BS, "linear"), XS).a, XS @ WS + BS, rtol=1e-5)
    assert len(traces) == 2  # new aux data: traced again


def test_grad_with_respect_to_a_registered_dataclass():
    def loss(p, x):
        return fnp.sum((x @ p.w + p.b) ** 2) * p.scale

    g = fj.grad(loss)(Params(WS, BS, 0.5), XS)
    assert isinstance(g, Params) and g.scale == 0.5
    y = XS @ WS + BS
    np.testing.assert_allclose(g.w, XS.T @ (2 * y * 0.5), rtol=1e-4)
    np.testing.assert_allclose(g.b, (2 * y * 0.5).sum(0), rtol=1e-4)
    gj = fj.jit(fj.grad(loss))(Params(WS, BS, 0.5), XS)
    np.testing.assert_allclose(gj.w, g.w, rtol=1e-5)


def test_registration_errors_say_what_to_do():
    class NotADataclass:
        pass

    with pytest.raises(fj.FlowjitTypeError, match="not a dataclass"):
        fj.tree_util.register_dataclass(NotADataclass)
    with pytest.raises(fj.FlowjitValueError, match="already a pytree node"):
        fj.tree_util.register_pytree_node(Box, lambda b: ((), None), lambda aux, c: Box(0, 0))
    with pytest.raises(fj.FlowjitTypeError, match="has no tree_flatten"):
        fj.tree_util.register_pytree_node_class(NotADataclass)

    class Listy:
        def __init__(self, x):
            self.x = x

    fj.tree_util.register_pytree_node(Listy, lambda n: ([n.x], ["unhashable"]), lambda aux, c: Listy(*c))
    with pytest.raises(fj.FlowjitTypeError, match="aux data .* not hashable"):
        fj.tree_flatten(Listy(1))
