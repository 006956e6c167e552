"""The α-β network model: textbook collective costs, and plans priced on links."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import commopt
from commopt.sim import network

A, B = 3e-5, 2.5e8            # α seconds per message, β bytes per second
LINK = network.Link(latency=A, bandwidth=B)
S = 4e6


@pytest.mark.parametrize("n", [2, 3, 8, 64, 1000])
def test_ring_costs_are_the_textbook_ones(n):
  t = lambda kind: network.collective_time(kind, n, S, LINK, "ring")
  assert math.isclose(t("all-reduce"), 2 * (n - 1) / n * S / B + 2 * (n - 1) * A)
  assert math.isclose(t("reduce-scatter"), (n - 1) / n * S / B + (n - 1) * A)
  assert math.isclose(t("all-gather"), (n - 1) * S / B + (n - 1) * A)
  assert math.isclose(t("all-to-all"), (n - 1) / n * S / B + (n - 1) * A)
  # An all-reduce is a reduce-scatter then an all-gather of the 1/n shards.
  assert math.isclose(t("all-reduce"), t("reduce-scatter")
                      + network.collective_time("all-gather", n, S / n, LINK, "ring"))


@pytest.mark.parametrize("n", [2, 5, 8, 1024])
def test_tree_costs_are_the_textbook_ones(n):
  L = math.ceil(math.log2(n))
  t = lambda kind: network.collective_time(kind, n, S, LINK, "tree")
  assert math.isclose(t("all-reduce"), 2 * L * (A + S / B))
  assert math.isclose(t("reduce-scatter"), L * A + (n - 1) / n * S / B)
  assert math.isclose(t("all-gather"), L * A + (n - 1) * S / B)
  assert math.isclose(t("all-to-all"), L * A + L / 2 * S / B)


def test_a_shared_medium_carries_every_workers_bytes():
  n = 4
  ring = network.collective_time("all-reduce", n, S, LINK, "ring")
  shared = network.collective_time("all-reduce", n, S, LINK, "shared")
  # The same messages; the bytes of all n workers go through one medium.
  assert math.isclose(shared - 2 * (n - 1) * A, n * (ring - 2 * (n - 1) * A))
  assert network.collective_time("all-gather", 1, S, LINK, "shared") == 0.0


def test_predict_prices_the_plan_per_axis():
  params = {"w": jnp.zeros((512, 512)), "b": jnp.zeros((512,))}
  fast, slow = network.Link.gbit(100.0, 1e-6), network.Link.gbit(1.0, 1e-5)
  net = network.Network.two_level(fast, slow)
  tx = commopt.compressed_mean(commopt.scaled_sign(), axis_name=("node", "local"), strategy="hierarchical")
  plan = commopt.wire.comm_plan(tx, params, (4, 8))
  got = network.predict(tx, params, (4, 8), net, compute_s=0.01)
  want = sum(network.collective_time(c.kind, c.group_size, c.contributed_bytes,
                                     fast if c.axis == "local" else slow) for c in plan.collectives)
  assert {c.axis for c in plan.collectives} == {"node", "local"}
  assert math.isclose(got.comm_s, want) and math.isclose(got.step_s, 0.01 + want)
  assert got.sent_bytes == plan.sent_bytes
  # Against a dense all-reduce of all 32 workers over the slow links, it pays.
  assert got.dense_comm_s > 5 * got.comm_s


def test_predict_follows_a_synchronisation_schedule():
  import optax
  params = {"w": jnp.zeros((256, 256))}
  tx = commopt.diloco(optax.sgd(0.1), axis_name="data", period=4)
  net = network.Network(network.Link.gbit(10.0, 1e-5))
  times = [network.predict(tx, params, 8, net, step=t).comm_s for t in range(8)]
  assert times[3] == times[7] > 0 and all(times[t] == 0 for t in (0, 1, 2, 4, 5, 6))
  np.testing.assert_allclose(times[3], network.predict(tx, params, 8, net).dense_comm_s)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match=r"collective_time: `kind` must be one of"):
    network.collective_time("broadcast", 4, S, LINK)
  with pytest.raises(ValueError, match=r"collective_time: `topology` must be one of \('ring', "
                                       r"'tree', 'shared'\), got 'mesh'"):
    network.collective_time("all-reduce", 4, S, LINK, "mesh")
  with pytest.raises(ValueError, match=r"Link: `bandwidth` must be a number in \(0, inf\), got 0"):
    network.Link(latency=0.0, bandwidth=0)
  with pytest.raises(ValueError, match=r"collective_time: `group_size` must be a positive integer"):
    network.collective_time("all-reduce", 0, S, LINK)
