"""The examples users run first must keep working: they train for real and reach real accuracy."""

import importlib.util
import os

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_digits():
    pytest.importorskip("sklearn")
    return _load("train_digits")


def test_mlp_reaches_95_percent(train_digits):
    results = train_digits.main(["--epochs", "10", "--model", "mlp"])
    assert results["mlp"] >= 0.95


def test_cnn_learns(train_digits):
    results = train_digits.main(["--epochs", "4", "--model", "cnn"])
    assert results["cnn"] >= 0.90


def test_ps_training_reaches_the_one_process_accuracy_without_the_straggler():
    pytest.importorskip("sklearn")
    pytest.importorskip("ray", reason="the `distributed` extra (Ray) is not installed")
    results = _load("ps_train").main(["--steps", "120", "--slow", "0.3"])
    assert results["distributed"] >= 0.9 and results["distributed"] >= results["one_process"] - 0.02
    assert results["dropped"] > 0 and results["slow_used"] <= 1  # step 0 may wait for compiles, not for it


def test_per_example_gradients_equal_a_loop_and_dp_sgd_learns():
    pytest.importorskip("sklearn")
    results = _load("per_example_grads").main(["--steps", "150"])
    assert results["max_difference"] < 1e-5
    assert results["accuracy"] >= 0.85


def test_gp_regression_fits_and_equals_numpy():
    results = _load("gp_regression").main(["--steps", "40"])
    assert results["final_loss"] < results["start_loss"] - 20 and results["fit_error"] < 0.15
    assert results["loss_error"] < 1e-10 and results["grad_error"] < 1e-6
    assert results["mean_error"] < 1e-10 and results["variance_error"] < 1e-10
