"""The ZeRO benchmarks' models (``bench_zero.py``, ``bench_nodes.py``) and ZeRO++'s
quantizers."""

from __future__ import annotations


def quantizer(bits: int):
  """ZeRO++'s quantizer of ``bits`` bits (8: qwZ's weights, 4: qgZ's gradients):
  ``int_quant``, nearest rounding, blocks of 2048."""
  import commopt
  return commopt.int_quant(bits=bits, block_size=2048, rounding="nearest")


def problem(width, seed=0):
  """``(params, loss_fn, batch)``: an MLP regression (64 -> ``width`` -> ``width`` -> 8, tanh)
  of a fixed teacher; ``batch(step, size=256)`` is step ``step``'s rows."""
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(seed)
  dims = [64, width, width, 8]
  params = {}
  for i, (a, b) in enumerate(zip(dims, dims[1:])):
    params[f"w{i}"] = jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
    params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
  teacher = rng.normal(size=(64, 8)).astype(np.float32) / 8

  def loss_fn(p, b):
    h = b["x"]
    for i in range(len(dims) - 1):
      h = h @ p[f"w{i}"] + p[f"b{i}"]
      h = jnp.tanh(h) if i < len(dims) - 2 else h
    return jnp.mean((h - b["y"]) ** 2)

  def batch(step, size=256):
    r = np.random.default_rng(1000 + step)
    x = r.normal(size=(size, 64)).astype(np.float32)
    return {"x": x, "y": np.tanh(x @ teacher).astype(np.float32)}

  return params, loss_fn, batch


def stacked_problem(width, layers, seed=0):
  """A residual MLP: 64 inputs, ``layers`` stacked ``width x width`` tanh blocks, 8 outputs;
  its loss gathers one layer at a time (``gather="manual"``)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import commopt
  rng = np.random.default_rng(seed)
  params = {"embed": jnp.asarray(rng.normal(size=(64, width)) / 8, jnp.float32),
            "layers": {"w": jnp.asarray(rng.normal(size=(layers, width, width))
                                        / (2 * np.sqrt(width)), jnp.float32),
                       "b": jnp.zeros((layers, width), jnp.float32)},
            "head": jnp.asarray(rng.normal(size=(width, 8)) / np.sqrt(width), jnp.float32)}
  _, _, batch = problem(width, seed)

  def loss_fn(p, b, gather):
    head = gather(p["head"])
    # The loop after the head's gather, and its backward before the head's reduce-scatter:
    # across CPU processes two collectives of one step must not run side by side.
    h = commopt.comm.after(jnp.tanh(b["x"] @ gather(p["embed"])), head)
    def block(h, rows):
      layer = gather(rows)
      return h + jnp.tanh(h @ layer["w"] + layer["b"]), None
    body = gather.remat(block)
    h, _ = jax.lax.scan(body, h, p["layers"])
    return jnp.mean((h @ head - b["y"]) ** 2)

  return params, loss_fn, batch
