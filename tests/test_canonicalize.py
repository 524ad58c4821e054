"""canonicalize against the reference interpreter: random small programs written with `flowjit.jit` and
`flowjit.numpy` give bit-identical results (nan, inf and -0.0 included) before and after the pass,
keep every op's source location, and every rule in `RULES` has lit tests."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.ir.interpreter import interpret
from flowjit.ir.location import UNKNOWN
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph
from flowjit.ir.verifier import verify
from flowjit.passes.canonicalize import RULES, canonicalize

SHAPE = (3, 4)
LIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lit", "canonicalize")

# Steps a random program takes, by the kind of value they read: "f" f32, "i" i32, "b" bool. Many are
# written to trigger a rule or a fold (x * 1.0, x - x, double transposes, constant subexpressions).
FLOAT_STEPS = [
    lambda a, b: a + b,
    lambda a, b: a - b,
    lambda a, b: a * b,
    lambda a, b: a / b,
    lambda a, b: fnp.maximum(a, b),
    lambda a, b: fnp.minimum(a, a),
    lambda a, b: a * 1.0,
    lambda a, b: 1.0 * a,
    lambda a, b: a + 0.0,
    lambda a, b: a - 0.0,
    lambda a, b: a + fnp.full(SHAPE, -0.0, np.float32),
    lambda a, b: a * 0.0,
    lambda a, b: a / 1.0,
    lambda a, b: a**1,
    lambda a, b: a - a,
    lambda a, b: fnp.negative(fnp.negative(a)),
    lambda a, b: fnp.exp(a),
    lambda a, b: fnp.log(a),
    lambda a, b: fnp.tanh(b),
    lambda a, b: a.T.T,
    lambda a, b: a.reshape(12).reshape(SHAPE),
    lambda a, b: a.reshape(4, 3).T,
    lambda a, b: a.astype(np.float64).astype(np.float32),
    lambda a, b: a.astype(np.float16).astype(np.float32),
    lambda a, b: fnp.concatenate([a], axis=0),
    lambda a, b: fnp.sum(a, axis=()),
    lambda a, b: fnp.broadcast_to(a[0], SHAPE),
    lambda a, b: a[0:3, 0:4],
    lambda a, b: a.sum(axis=1, keepdims=True) * b,
    lambda a, b: (fnp.ones(SHAPE, np.float32) * 2.0 + 1.0) * a,
    lambda a, b: fnp.exp(fnp.full(SHAPE, 0.5, np.float32)) - a,
    lambda a, b: fnp.where(a < b, a, b),
    lambda a, b: fnp.where(a < b, a, a),
    # Control flow: the pass works inside regions, which stay self-contained.
    lambda a, b: fj.cond(fnp.sum(a) > 0.0, lambda u, v: u * 1.0 + v, lambda u, v: -(u - 0.0), a, b),
    lambda a, b: fj.fori_loop(0, 2, lambda i, c: fnp.minimum(c, c) * 1.0 + b, a),
]
INT_STEPS = [
    lambda a, b: a + b,
    lambda a, b: a - a,
    lambda a, b: a * 0,
    lambda a, b: 0 * a,
    lambda a, b: a * 1,
    lambda a, b: a - 0,
    lambda a, b: a + 0,
    lambda a, b: fnp.negative(fnp.negative(a)),
    lambda a, b: a.astype(np.int64).astype(np.int32),
    lambda a, b: fnp.maximum(a, a),
    lambda a, b: a // fnp.full(SHAPE, 3, np.int32),
    lambda a, b: fnp.sum(a, axis=()) + b,
    lambda a, b: (fnp.arange(12, dtype=np.int32).reshape(SHAPE) * 2) + a,
]
BOOL_STEPS = [
    lambda a, b: fnp.logical_and(a, a),
    lambda a, b: fnp.logical_or(a, b),
    lambda a, b: fnp.logical_not(fnp.logical_not(a)),
    lambda a, b: fnp.logical_xor(a, a),
]
CROSS_STEPS = [  # (reads, writes, step)
    ("f", "i", lambda a, b: a.astype(np.int32)),
    ("i", "f", lambda a, b: a.astype(np.float32)),
    ("f", "b", lambda a, b: a < b),
    ("i", "b", lambda a, b: a == b),
    ("b", "f", lambda a, b: a.astype(np.float32)),
    ("b", "i", lambda a, b: a.astype(np.int32).astype(np.int64).astype(np.int32)),
]
STEPS = [("f", "f", s) for s in FLOAT_STEPS] + [("i", "i", s) for s in INT_STEPS]
STEPS += [("b", "b", s) for s in BOOL_STEPS] + CROSS_STEPS


def random_program(seed: int, num_steps: int = 14):
    """A function of (x: f32, y: f32, i: i32, j: i32, p: bool) applying random steps; returns a random
    subset of everything it computed (so DCE has work)."""
    rng = np.random.default_rng(seed)
    plan = [(STEPS[k], rng.integers(0, 1 << 30, size=2)) for k in rng.integers(0, len(STEPS), size=num_steps)]
    keep = rng.random(num_steps + 5) < 0.5

    def program(x, y, i, j, p):
        pools = {"f": [x, y], "i": [i, j], "b": [p]}
        computed = [x, y, i, j, p]
        for (reads, writes, step), (r1, r2) in plan:
            pool = pools[reads]
            out = step(pool[r1 % len(pool)], pool[r2 % len(pool)])
            pools[writes].append(out)
            computed.append(out)
        chosen = [v for v, k in zip(computed, keep) if k]
        return tuple(chosen or computed[-1:])

    return program


SPECIAL = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -1.0, 0.5, 3.0, 1e30, -2.5, 7.0], np.float32)
INT_EDGES = np.array([0, 1, -1, 2, 7, -3, np.iinfo(np.int32).max, np.iinfo(np.int32).min], np.int32)


def random_inputs(rng):
    return [
        rng.choice(SPECIAL, SHAPE).astype(np.float32),
        rng.choice(SPECIAL, SHAPE).astype(np.float32),
        rng.choice(INT_EDGES, SHAPE).astype(np.int32),
        rng.choice(INT_EDGES, SHAPE).astype(np.int32),
        rng.random(SHAPE) < 0.5,
    ]


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    """Equal dtype, shape and values; nan where the other is nan, and zeros with the same sign."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.kind == "f":
        assert np.array_equal(np.isnan(a), np.isnan(b))
        keep = ~np.isnan(a)
        assert a[keep].tobytes() == b[keep].tobytes()
    else:
        assert a.tobytes() == b.tobytes()


SPECS = [
    fj.ShapeDtype(SHAPE, "float32"),
    fj.ShapeDtype(SHAPE, "float32"),
    fj.ShapeDtype(SHAPE, "int32"),
    fj.ShapeDtype(SHAPE, "int32"),
    fj.ShapeDtype(SHAPE, "bool"),
]


@pytest.mark.parametrize("seed", range(60))
def test_canonicalize_preserves_results_of_random_programs(seed):
    traced = fj.jit(random_program(seed)).lower(*SPECS).graph("traced")
    text = print_graph(traced)
    assert print_graph(parse_graph(text)) == text  # the round trip holds for real traces too
    optimized = canonicalize(parse_graph(text))
    verify(optimized)
    assert all(op.loc != UNKNOWN for op in optimized.walk()), "a rewrite dropped a source location"
    assert len(optimized.ops) <= len(traced.ops)
    rng = np.random.default_rng(seed)
    with np.errstate(all="ignore"):
        for _ in range(3):
            args = random_inputs(rng)
            for before, after in zip(interpret(traced, args), interpret(optimized, args)):
                assert_same_bits(before, after)


def test_canonicalize_simplifies_random_programs():
    # The differential test above is only meaningful if the pass does work on these programs.
    removed = 0
    for seed in range(20):
        traced = fj.jit(random_program(seed)).lower(*SPECS).graph("traced")
        removed += len(traced.ops) - len(canonicalize(parse_graph(print_graph(traced))).ops)
    assert removed > 100


def test_canonicalize_is_idempotent():
    for seed in range(10):
        traced = fj.jit(random_program(seed)).lower(*SPECS).graph("traced")
        once = print_graph(canonicalize(parse_graph(print_graph(traced))))
        assert print_graph(canonicalize(parse_graph(once))) == once


@pytest.mark.parametrize("op_name", sorted(RULES))
def test_every_rule_has_lit_tests(op_name):
    # Each rule's lit file shows where it fires and where it must not (a `@does_not_fire` function).
    files = [f for f in glob.glob(os.path.join(LIT_DIR, "rule-*.fj")) if f'RULES["{op_name}"]' in open(f).read()]
    assert files, f'no tests/lit/canonicalize/rule-*.fj names RULES["{op_name}"] in its header'
    text = open(files[0]).read()
    assert f"= {op_name} " in text and "func @does_not_fire" in text and "func @fires" in text
