# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The wire on real architectures
#
# What one worker sends per step, and how much less than a dense all-reduce, for
# every registered compressor and PowerSGD at ranks 1, 2 and 4, on the
# parameter trees of ResNet-18 and ResNet-50 (CIFAR and ImageNet heads),
# ViT-B/16 and GPT-2 small. The trees come from Flax nnx definitions through
# `nnx.eval_shape`: shapes only, no weights, so this runs in seconds.
#
# Bytes are `commopt.wire.comm_plan`'s: each worker's sends under the ring
# model, at 8 workers, with each compressor's default reduction (`auto`) and
# with `two_phase` where the compressor takes it. Leaves under 1024 elements
# (biases, norms) go dense, as `compressed_mean` sends them.
#
# **Layout rule.** PowerSGD compresses a leaf viewed as a matrix. Flax keeps
# conv kernels as `[kh, kw, in, out]` and dense kernels as `[in, out]`;
# commopt's default `view="last"` makes that `[kh·kw·in, out]`, which is the
# transpose of PyTorch's rule on PyTorch's `[out, in, kh, kw]` layout
# (`[out, in·kh·kw]`): the same (n + m)·r bytes. The table shows it, and
# beside it `view="first"`, PyTorch's rule applied to Flax's layout as it
# stands (`[kh, kw·in·out]`), to show what a layout mistake costs.
#
# Set `COMMOPT_NOTEBOOK_SMALL=1` to run only ResNet-18 (CIFAR) and GPT-2 small.

# %%
import os
import pathlib

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from flax import nnx

import commopt
from commopt import wire

SMALL = os.environ.get("COMMOPT_NOTEBOOK_SMALL") == "1"
WORKERS = 8
OUT = pathlib.Path(os.environ.get("COMMOPT_NOTEBOOK_OUT", "runs/notebooks"))
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## The architectures (parameters only)

# %%
def conv(cin, cout, k, stride=1, bias=False, *, rngs):
  return nnx.Conv(cin, cout, (k, k), strides=stride, padding="SAME", use_bias=bias, rngs=rngs)


class Basic(nnx.Module):
  """ResNet's basic block: two 3×3 convolutions."""
  expansion = 1

  def __init__(self, cin, width, stride, *, rngs):
    self.conv1, self.bn1 = conv(cin, width, 3, stride, rngs=rngs), nnx.BatchNorm(width, rngs=rngs)
    self.conv2, self.bn2 = conv(width, width, 3, rngs=rngs), nnx.BatchNorm(width, rngs=rngs)
    if stride != 1 or cin != width:
      self.down = nnx.Sequential(conv(cin, width, 1, stride, rngs=rngs),
                                 nnx.BatchNorm(width, rngs=rngs))


class Bottleneck(nnx.Module):
  """ResNet's bottleneck block: 1×1, 3×3, 1×1 (×4)."""
  expansion = 4

  def __init__(self, cin, width, stride, *, rngs):
    out = width * 4
    self.conv1, self.bn1 = conv(cin, width, 1, rngs=rngs), nnx.BatchNorm(width, rngs=rngs)
    self.conv2, self.bn2 = conv(width, width, 3, stride, rngs=rngs), nnx.BatchNorm(width, rngs=rngs)
    self.conv3, self.bn3 = conv(width, out, 1, rngs=rngs), nnx.BatchNorm(out, rngs=rngs)
    if stride != 1 or cin != out:
      self.down = nnx.Sequential(conv(cin, out, 1, stride, rngs=rngs), nnx.BatchNorm(out, rngs=rngs))


class ResNet(nnx.Module):
  def __init__(self, block, depths, classes, cifar, *, rngs):
    # CIFAR: a 3×3 stem without pooling; ImageNet: 7×7, stride 2.
    self.stem = conv(3, 64, 3 if cifar else 7, 1 if cifar else 2, rngs=rngs)
    self.bn = nnx.BatchNorm(64, rngs=rngs)
    blocks, cin = [], 64
    for stage, depth in enumerate(depths):
      width = 64 * 2 ** stage
      for i in range(depth):
        blocks.append(block(cin, width, 2 if stage and not i else 1, rngs=rngs))
        cin = width * block.expansion
    self.blocks = nnx.List(blocks)
    self.head = nnx.Linear(cin, classes, rngs=rngs)


class Attention(nnx.Module):
  def __init__(self, d, *, rngs):
    self.qkv, self.proj = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)


class TransformerBlock(nnx.Module):
  def __init__(self, d, hidden, *, rngs):
    self.ln1, self.attn = nnx.LayerNorm(d, rngs=rngs), Attention(d, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc, self.out = nnx.Linear(d, hidden, rngs=rngs), nnx.Linear(hidden, d, rngs=rngs)


class ViT(nnx.Module):
  """ViT-B/16 at 224×224: 196 patches and a class token, 12 blocks of width 768."""

  def __init__(self, *, rngs, d=768, depth=12, classes=1000):
    self.patch = conv(3, d, 16, 16, bias=True, rngs=rngs)
    self.cls = nnx.Param(jnp.zeros((1, 1, d)))
    self.pos = nnx.Param(jnp.zeros((1, 197, d)))
    self.blocks = nnx.List([TransformerBlock(d, 4 * d, rngs=rngs) for _ in range(depth)])
    self.ln, self.head = nnx.LayerNorm(d, rngs=rngs), nnx.Linear(d, classes, rngs=rngs)


class GPT2(nnx.Module):
  """GPT-2 small: 12 blocks of width 768, 1024 positions, the output head tied to wte."""

  def __init__(self, *, rngs, d=768, depth=12, vocab=50257, positions=1024):
    self.wte, self.wpe = nnx.Embed(vocab, d, rngs=rngs), nnx.Embed(positions, d, rngs=rngs)
    self.blocks = nnx.List([TransformerBlock(d, 4 * d, rngs=rngs) for _ in range(depth)])
    self.ln_f = nnx.LayerNorm(d, rngs=rngs)


ARCHITECTURES = {
    "ResNet-18 (CIFAR)": (lambda r: ResNet(Basic, (2, 2, 2, 2), 10, True, rngs=r), 11_173_962),
    "ResNet-18 (ImageNet)": (lambda r: ResNet(Basic, (2, 2, 2, 2), 1000, False, rngs=r),
                             11_689_512),
    "ResNet-50 (CIFAR)": (lambda r: ResNet(Bottleneck, (3, 4, 6, 3), 10, True, rngs=r),
                          23_520_842),
    "ResNet-50 (ImageNet)": (lambda r: ResNet(Bottleneck, (3, 4, 6, 3), 1000, False, rngs=r),
                             25_557_032),
    "ViT-B/16": (lambda r: ViT(rngs=r), 86_567_656),
    "GPT-2 small": (lambda r: GPT2(rngs=r), 124_439_808),
}
if SMALL:
  ARCHITECTURES = {k: v for k, v in ARCHITECTURES.items()
                   if k in ("ResNet-18 (CIFAR)", "GPT-2 small")}


def parameter_tree(build):
  """The trainable parameters' shapes, as a plain dict of ShapeDtypeStructs."""
  abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
  return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


trees = {}
for name, (build, expected) in ARCHITECTURES.items():
  trees[name] = parameter_tree(build)
  count = sum(x.size for x in jax.tree.leaves(trees[name]))
  # The published parameter counts (torchvision, timm, Hugging Face), so the
  # definitions above are the real architectures.
  assert count == expected, (name, count, expected)
  print(f"{name:22s} {count / 1e6:7.2f} M parameters in {len(jax.tree.leaves(trees[name]))} leaves")

# %% [markdown]
# ## Bytes per step for every compressor

# %%
def compressors():
  """(label, compressor) for every registered compressor with its defaults, and PowerSGD's ranks."""
  out = [(name, commopt.compressors.make(name)) for name in sorted(commopt.compressors.REGISTRY)
         if name != "power_sgd"]
  for rank in (1, 2, 4):
    out.append((f"power_sgd({rank})", commopt.power_sgd(rank)))
    out.append((f"power_sgd({rank}), view=first", commopt.power_sgd(rank, view="first")))
  return out


rows = []
for arch, params in trees.items():
  for label, c in compressors():
    auto = wire.comm_plan(c, params, WORKERS)
    two = (wire.comm_plan(c, params, WORKERS, strategy="two_phase")
           if "flat_chunks" in c.capabilities else None)
    rows.append(dict(arch=arch, compressor=label, sent=auto.sent_bytes, ratio=auto.ratio,
                     two_phase=None if two is None else two.ratio, dense=auto.dense_sent))


def table(arch):
  lines = [f"{arch}: dense all-reduce sends "
           f"{next(r['dense'] for r in rows if r['arch'] == arch) / 1e6:.1f} MB per worker",
           "| compressor | MB sent per worker (auto) | × less than dense | × less with two_phase |",
           "|---|---|---|---|"]
  for r in rows:
    if r["arch"] == arch:
      two = "-" if r["two_phase"] is None else f"{r['two_phase']:.1f}"
      lines.append(f"| {r['compressor']} | {r['sent'] / 1e6:.2f} | {r['ratio']:.1f} | {two} |")
  return "\n".join(lines)


for arch in trees:
  print(table(arch), end="\n\n")

# %% [markdown]
# ## The ratios side by side

# %%
labels = [label for label, _ in compressors()]
fig, ax = plt.subplots(figsize=(12, 5))
width = 0.8 / len(trees)
for i, arch in enumerate(trees):
  ratios = [next(r["ratio"] for r in rows if r["arch"] == arch and r["compressor"] == l)
            for l in labels]
  ax.bar([j + i * width for j in range(len(labels))], ratios, width, label=arch)
ax.set_yscale("log")
ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=60, ha="right",
              fontsize=8)
ax.set_ylabel(f"× fewer bytes than a dense all-reduce ({WORKERS} workers)")
ax.grid(True, axis="y", which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "wire_architectures.png", dpi=120)
(OUT / "wire_architectures.md").write_text("\n\n".join(table(a) for a in trees) + "\n")
print(f"wrote {OUT / 'wire_architectures.png'} and {OUT / 'wire_architectures.md'}")
