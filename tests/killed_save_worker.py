"""Saves a checkpoint, then is killed while saving the next one (half its checksums written).

Run as ``python tests/killed_save_worker.py OUT``: ``OUT/step_1`` is a complete
checkpoint; the save of ``OUT/step_2`` stalls after writing half of its checksum
file and writes ``OUT/stalled``, and the caller kills the process there.
"""

import pathlib
import sys
import time


def main(out: pathlib.Path) -> None:
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  import optax

  import commopt
  from commopt import checkpoint

  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=0),
                   optax.sgd(0.2, momentum=0.9))
  dp = commopt.data_parallel(lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2),
                             tx, jax.make_mesh((8,), ("data",)), donate=False)
  params = {"w": jnp.full((64, 48), 0.5), "b": jnp.zeros(48)}
  state = dp.init(params)
  checkpoint.save(out / "step_1", params, state, step=1)

  def stalls(directory, data):
    # Every array written, the checksum file half written: the process is killed here.
    with open(pathlib.Path(directory) / checkpoint.CHECKSUMS, "wb") as f:
      f.write(data[:len(data) // 2])
    (out / "stalled").write_text(str(directory))
    time.sleep(600)

  checkpoint._checksums.write = stalls   # what the handler calls as it finalizes the item
  checkpoint.save(out / "step_2", jax.tree.map(lambda x: x + 1, params), state, step=2)


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
