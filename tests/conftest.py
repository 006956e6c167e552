"""Shared test setup: eight simulated CPU devices, a quick hypothesis profile, meshes.

Tiers: the default run skips tests marked ``slow`` (the example scripts and
the robustness studies run as subprocesses or train for many steps);
``pytest -m slow`` runs them, and CI runs both.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")

WORKERS = 8
"""The simulated devices, all of them data-parallel workers in the 1-D mesh."""


@pytest.fixture(scope="session")
def mesh():
  """All 8 devices on one ``"data"`` axis."""
  return jax.make_mesh((WORKERS,), ("data",))


@pytest.fixture(scope="session")
def mesh2d():
  """2 nodes × 4 local devices: ``("node", "local")``."""
  return jax.make_mesh((2, 4), ("node", "local"))
