"""Gaussian-process regression, as in JAX's example (examples/gaussian_process_regression.py).

An RBF kernel with an amplitude, a length scale and a noise level (all positive: optimized as their
logs), the negative log marginal likelihood through a Cholesky factor and triangular solves, its
gradient with fj.grad under fj.jit for the hyper-parameter fit, and the posterior mean and variance
on a grid. The likelihood, its gradient and the predictions are checked against numpy (with finite
differences for the gradient).

    python examples/gp_regression.py [--steps 60] [--points 40]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.scipy.linalg import cho_factor, cho_solve, solve_triangular


def rbf(x1, x2, log_amp, log_length):
    """amp * exp(-|x1 - x2|^2 / (2 length^2)) for 1-D inputs."""
    d = (x1[:, None] - x2[None, :]) / fnp.exp(log_length)
    return fnp.exp(log_amp) * fnp.exp(-0.5 * d * d)


def neg_log_marginal_likelihood(params, x, y):
    """-log p(y | x, params) = y^T K^-1 y / 2 + log|K| / 2 + n log(2 pi) / 2, K = k(x, x) + noise I."""
    log_amp, log_length, log_noise = params[0], params[1], params[2]
    n = x.shape[0]
    kernel = rbf(x, x, log_amp, log_length) + (fnp.exp(log_noise) + 1e-6) * fnp.eye(n, dtype=x.dtype)
    factor = cho_factor(kernel, lower=True)
    alpha = cho_solve(factor, y)
    log_det = 2.0 * fnp.sum(fnp.log(fnp.diagonal(factor[0])))
    return 0.5 * fnp.dot(y, alpha) + 0.5 * log_det + 0.5 * n * np.log(2 * np.pi)


@fj.jit
def train_step(params, velocity, x, y, lr):
    """One step of gradient descent with momentum on the hyper-parameters."""
    loss, grads = fj.value_and_grad(neg_log_marginal_likelihood)(params, x, y)
    velocity = 0.9 * velocity - lr * grads
    return params + velocity, velocity, loss


@fj.jit
def predict(params, x, y, x_test):
    """The posterior mean and variance at x_test."""
    log_amp, log_length, log_noise = params[0], params[1], params[2]
    n = x.shape[0]
    kernel = rbf(x, x, log_amp, log_length) + (fnp.exp(log_noise) + 1e-6) * fnp.eye(n, dtype=x.dtype)
    lower = fnp.linalg.cholesky(kernel)
    cross = rbf(x, x_test, log_amp, log_length)
    alpha = solve_triangular(lower, solve_triangular(lower, y, lower=True), lower=True, trans=1)
    v = solve_triangular(lower, cross, lower=True)
    mean = cross.T @ alpha
    variance = fnp.exp(log_amp) - fnp.sum(v * v, axis=0)
    return mean, variance


# --- the same in numpy, to check against ---------------------------------------------------------------------


def numpy_nlml(params, x, y):
    amp, length, noise = np.exp(params)
    kernel = amp * np.exp(-0.5 * ((x[:, None] - x[None, :]) / length) ** 2) + (noise + 1e-6) * np.eye(len(x))
    sign, log_det = np.linalg.slogdet(kernel)
    return 0.5 * y @ np.linalg.solve(kernel, y) + 0.5 * log_det + 0.5 * len(x) * np.log(2 * np.pi)


def numpy_predict(params, x, y, x_test):
    amp, length, noise = np.exp(params)
    k = lambda a, b: amp * np.exp(-0.5 * ((a[:, None] - b[None, :]) / length) ** 2)  # noqa: E731
    kernel = k(x, x) + (noise + 1e-6) * np.eye(len(x))
    cross = k(x, x_test)
    mean = cross.T @ np.linalg.solve(kernel, y)
    variance = amp - np.einsum("ij,ij->j", cross, np.linalg.solve(kernel, cross))
    return mean, variance


def finite_difference_gradient(params, x, y, eps=1e-6):
    steps = np.eye(len(params)) * eps
    return np.array([(numpy_nlml(params + s, x, y) - numpy_nlml(params - s, x, y)) / (2 * eps) for s in steps])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--points", type=int, default=40)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    x = np.sort(rng.uniform(-3.0, 3.0, args.points))
    y = np.sin(2.0 * x) + 0.1 * rng.standard_normal(args.points)
    x_test = np.linspace(-3.0, 3.0, 50)
    params = np.array([0.0, 0.0, -1.0])  # log amplitude, log length scale, log noise
    velocity = np.zeros(3)

    start_loss, start_grad = fj.jit(fj.value_and_grad(neg_log_marginal_likelihood))(params, x, y)
    start = time.perf_counter()
    for _ in range(args.steps):
        params, velocity, loss = train_step(params, velocity, x, y, 0.01)
    fit_seconds = time.perf_counter() - start
    mean, variance = predict(params, x, y, x_test)

    mean_np, variance_np = numpy_predict(params, x, y, x_test)
    results = {
        "start_loss": float(start_loss),
        "final_loss": float(neg_log_marginal_likelihood(params, x, y)),
        "loss_error": abs(float(start_loss) - numpy_nlml(np.array([0.0, 0.0, -1.0]), x, y)),
        "grad_error": float(np.max(np.abs(start_grad - finite_difference_gradient(np.array([0.0, 0.0, -1.0]), x, y)))),
        "mean_error": float(np.max(np.abs(mean - mean_np))),
        "variance_error": float(np.max(np.abs(variance - variance_np))),
        "fit_error": float(np.sqrt(np.mean((mean - np.sin(2.0 * x_test)) ** 2))),
        "params": np.exp(params),
    }
    amp, length, noise = results["params"]
    print(
        f"negative log marginal likelihood: {results['start_loss']:.3f} -> {results['final_loss']:.3f} in "
        f"{args.steps} steps ({fit_seconds * 1e3:.1f} ms, the first step compiles)"
    )
    print(f"fitted amplitude {amp:.3f}, length scale {length:.3f}, noise {noise:.4f}")
    print(f"rms error of the posterior mean against sin(2x): {results['fit_error']:.3f}")
    print(
        f"against numpy: loss {results['loss_error']:.1e}, gradient vs finite differences "
        f"{results['grad_error']:.1e}, mean {results['mean_error']:.1e}, variance {results['variance_error']:.1e}"
    )
    return results


if __name__ == "__main__":
    main()
