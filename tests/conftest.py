"""Eight simulated CPU devices for every test, and a quick hypothesis profile."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")
