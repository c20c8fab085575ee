"""Writes the notebooks from the cells below and executes them in place.

Run from the repository root: ``python notebooks/build.py``. The executed
notebooks (with outputs, small figures) are what the repository ships; the
test suite re-executes them (tests/test_notebooks.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent

SETUP = """\
import warnings
import jax, jax.numpy as jnp, numpy as np, optax
import matplotlib.pyplot as plt
plt.rcParams.update({"figure.dpi": 60, "figure.figsize": (6, 3)})
import jmp_lite
from jmp_lite import examples
print("jax", jax.__version__, "on", jax.devices()[0].platform)"""


def loss_curves(legend: str = "") -> tuple[str, str]:
  """The cell that plots each run's training loss (15-step moving mean)."""
  return ("code", f"""\
fig, ax = plt.subplots()
for name, r in results.items():
  ax.plot(np.convolve(r.losses, np.ones(15) / 15, "valid"), label=name)
ax.set_yscale("log"); ax.set_xlabel("step"); ax.set_title("training loss")
ax.legend({legend})
fig.tight_layout()""")


NOTEBOOKS = {
    "01_quickstart": [
        ("md", """\
# Quickstart: one model in float32, bfloat16 and float16

A Flax MLP on scikit-learn's bundled **digits** (no download), trained three
ways with a precision policy and `jmp_lite.loss_scaled`:

* float32;
* bfloat16 compute (float32 params);
* float16 compute with dynamic loss scaling.

The training code is in `jmp_lite/examples.py`; its heart is the usual
three-line change:

```python
opt = jmp_lite.loss_scaled(optax.adam(lr), jmp_lite.DynamicLossScale(2.0 ** 15))
scale = jmp_lite.current_loss_scale(opt_state)       # in the step
grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(params)
```"""),
        ("code", SETUP),
        ("code", """\
runs = {
    "float32": examples.train_digits("f32", steps=300),
    "bfloat16": examples.train_digits("p=f32,c=bf16,o=f32", steps=300),
    "float16 + dynamic scale": examples.train_digits(
        "p=f32,c=f16,o=f32", jmp_lite.DynamicLossScale(2.0 ** 15, period=50),
        steps=300),
}
print(f"{'run':24} {'eval loss':>9} {'accuracy':>8} {'skipped':>7}")
for name, r in runs.items():
  print(f"{name:24} {r.eval_loss:9.4f} {r.accuracy:8.3f} {r.skipped:7d}")"""),
        ("code", """\
fig, (a, b) = plt.subplots(1, 2)
for name, r in runs.items():
  a.plot(np.convolve(r.losses, np.ones(10) / 10, "valid"), label=name)
a.set_yscale("log"); a.set_title("training loss"); a.legend(fontsize=7)
b.plot(runs["float16 + dynamic scale"].scales)
b.set_yscale("log", base=2); b.set_title("float16 loss scale")
fig.tight_layout()"""),
        ("md", """\
All three reach the same accuracy. The float16 run's scale grows by 2 every
50 finite steps (`period=50`) and would back off on an overflow; bfloat16
needs no scaling (float32's exponent range)."""),
    ],
    "02_comparison": [
        ("md", """\
# O0 / O1 / O2 / O3 and float16 + dynamic scaling, side by side

The usual comparison (Paddle's FP32 / O1 / O2 table, Colossal-AI's
throughput and memory) on the digits MLP: time per step, final loss, and
memory: params + optimizer state, and the activations kept for the backward
pass. On the CPU half precision is emulated, so the *times* favour float32
here; on a GPU or TPU they reverse. The *bytes* are what they would be
anywhere."""),
        ("code", SETUP),
        ("code", """\
kahan = {"optimizer": examples.low_precision_optimizer("kahan", "bf16")}
configs = {
    "O0 float32": ("f32", None, {}),
    "O1 bf16 compute": ("p=f32,c=bf16,o=f32", None, {}),
    "O2 bf16 + master": ("p=bf16,c=bf16,o=f32", None, {"master": True}),
    "O3 bf16 + Kahan": ("bf16", None, kahan),
    "fp16 + dynamic": ("p=f32,c=f16,o=f32",
                       jmp_lite.DynamicLossScale(2.0 ** 15), {}),
}
rows = {name: examples.train_digits(p, s, steps=300, **kw)
        for name, (p, s, kw) in configs.items()}
print(f"{'run':18} {'ms/step':>7} {'eval loss':>9} {'acc':>6}"
      f" {'params+opt':>10} {'activations':>11}")
for name, r in rows.items():
  print(f"{name:18} {r.ms_per_step:7.2f} {r.eval_loss:9.4f} {r.accuracy:6.3f}"
        f" {r.param_bytes + r.state_bytes:10,d} {r.activation_bytes:11,d}")"""),
        ("code", """\
names = list(rows)
fig, axes = plt.subplots(1, 3, figsize=(9, 3))
for ax, (title, values) in zip(axes, [
    ("ms / step", [rows[n].ms_per_step for n in names]),
    ("params + optimizer bytes",
     [rows[n].param_bytes + rows[n].state_bytes for n in names]),
    ("activation bytes", [rows[n].activation_bytes for n in names])]):
  ax.bar(range(len(names)), values)
  ax.set_xticks(range(len(names)), [n.split()[0] for n in names], fontsize=7)
  ax.set_title(title, fontsize=8)
fig.tight_layout()"""),
        ("md", """\
O2 stores bfloat16 params plus a float32 master copy in the optimizer, so its
params + optimizer bytes are higher than O0's. Its activations (the
residuals beyond the stored params) are 0.57x O0's here, not half:
they exceed the bf16-compute row's by exactly its bfloat16 params' bytes.
O3 (the preset's default recipe) keeps no float32 copy: bfloat16 params, a
bfloat16 Kahan compensation buffer and bfloat16 Adam moments computed in
float32, 8 bytes per parameter against O2's 14 (`05_pure_bf16` compares it
with plain pure bfloat16 and stochastic rounding)."""),
    ],
    "03_migration": [
        ("md", """\
# Migrating from jmp, Flax `DynamicScale` and PyTorch autocast + GradScaler"""),
        ("code", SETUP),
        ("md", """\
## From DeepMind's `jmp`

Code written for `jmp` runs unchanged with `import jmp_lite as jmp`. The
states now survive every pytree round trip and `jit(...).lower`; the one
behavioural difference is a default cap of 2**24 on the scale."""),
        ("code", """\
import jmp_lite as jmp          # was: import jmp

policy = jmp.get_policy("params=float32,compute=float16,output=float32")
loss_scale = jmp.DynamicLossScale(jnp.asarray(2.0 ** 15), period=2)
params = {"w": jnp.ones((3, 2))}
x = jnp.ones((4, 3))

def loss_fn(params, loss_scale):
  out = policy.cast_to_output(
      policy.cast_to_compute(x) @ policy.cast_to_compute(params["w"]))
  return loss_scale.scale(jnp.mean(out ** 2))

for _ in range(3):
  grads = loss_scale.unscale(jax.grad(loss_fn)(params, loss_scale))
  finite = jmp.all_finite(grads)
  new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  params = jmp.select_tree(finite, new_params, params)
  loss_scale = loss_scale.adjust(finite)
print(loss_scale.loss_scale, loss_scale.min_loss_scale)"""),
        ("md", """\
## From Flax `DynamicScale`

| Flax | jmp_lite |
| --- | --- |
| `dyn = DynamicScale()` in the train state | `opt = jmp_lite.loss_scaled(optax.adam(lr), jmp_lite.DynamicLossScale(2.0**16))` |
| `dyn, is_fin, loss, grads = dyn.value_and_grad(loss_fn)(params)` | `scale = jmp_lite.current_loss_scale(opt_state)`; `grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(params)` |
| `jnp.where(is_fin, new, old)` over params *and* opt state | done inside `opt.update`: skipped steps leave both bit-for-bit unchanged |

jmp_lite grows the scale on the `period`-th finite step (Flax grows one step
later) and accepts integer leaves."""),  # noqa: E501 (Markdown table rows)
        ("code", """\
opt = jmp_lite.loss_scaled(optax.adam(1e-2),
                           jmp_lite.DynamicLossScale(2.0 ** 16))
params = {"w": jnp.ones((3, 2)), "steps": jnp.array(0)}
opt_state = opt.init({"w": params["w"]})

@jax.jit
def train_step(params, opt_state):
  scale = jmp_lite.current_loss_scale(opt_state)
  grads = jax.grad(lambda w: scale.scale(jnp.mean((x @ w) ** 2)))(params["w"])
  updates, opt_state = opt.update({"w": grads}, opt_state, {"w": params["w"]})
  new = optax.apply_updates({"w": params["w"]}, updates)
  return {"w": new["w"], "steps": params["steps"] + 1}, opt_state

params, opt_state = train_step(params, opt_state)
print(params["steps"], opt_state.total_skips)"""),
        ("md", """\
## From PyTorch `autocast` + `GradScaler`

```python
# PyTorch
scaler = torch.cuda.amp.GradScaler()
with torch.autocast("cuda", dtype=torch.float16):
    loss = loss_fn(model(x), y)
scaler.scale(loss).backward()
scaler.unscale_(optimizer)
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(optimizer)
scaler.update()
```

In JAX the autocast is a function transformation, and the scaler is part of
the optimizer. `clip_by_global_norm` goes *inside* `loss_scaled`, which is
PyTorch's `unscale_` before clipping."""),
        ("code", """\
def loss_fn(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)

fast_loss = jmp_lite.autocast(loss_fn, jnp.float16)  # torch.autocast(...)
opt = jmp_lite.loss_scaled(                            # GradScaler
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    jmp_lite.DynamicLossScale(2.0 ** 16))
w = jnp.ones((3, 2)) * 0.5
opt_state = opt.init(w)

@jax.jit
def step(w, opt_state):
  scale = jmp_lite.current_loss_scale(opt_state)
  grads = jax.grad(lambda w: scale.scale(fast_loss(w, x)))(w)
  updates, opt_state = opt.update(grads, opt_state, w)
  return optax.apply_updates(w, updates), opt_state

for _ in range(3):
  w, opt_state = step(w, opt_state)
print(jmp_lite.autocast_audit(loss_fn, jnp.float16, w, x))"""),
    ],
    "04_debugging": [
        ("md", """\
# Debugging a diverging float16 run

A float16 run with no loss scaling and no master weights goes wrong. These
cells find out why: which step, which parameters, which operation, and what a
loss scale would have changed."""),
        ("code", SETUP),
        ("code", """\
bad = examples.train_digits("f16", jmp_lite.NoOpLossScale(), steps=100)
good = examples.train_digits("p=f32,c=f16,o=f32", steps=100)
print("pure float16: eval loss", bad.eval_loss,
      "skipped", bad.skipped, "of 100")
print("float16 compute + master params + dynamic scale: eval loss",
      round(good.eval_loss, 4), "skipped", good.skipped)
plt.plot(good.losses, label="mixed + dynamic scale")
plt.plot(bad.losses, label="pure float16")
plt.yscale("log"); plt.legend(); plt.title("training loss")"""),
        ("md", """\
`loss_scaled(..., track_nonfinite=True)` records, per parameter path, how
many gradient elements were non-finite in the last step. The step never
syncs with the host; reading the counts afterwards does."""),
        ("code", """\
import flax.linen as nn
from jmp_lite import linen as jl

x_tr, y_tr, _, _ = examples.load_digits_split()
x, y = jnp.asarray(x_tr[:128]), jnp.asarray(y_tr[:128])
mlp = nn.Sequential([nn.Dense(128), nn.relu, nn.Dense(10)])
model = jl.mixed_precision(mlp, "f16")
params = model.init(jax.random.key(0), x)["params"]
opt = jmp_lite.loss_scaled(optax.adam(1e-3), jmp_lite.NoOpLossScale(),
                           allow_half_state=True, track_nonfinite=True)
state = opt.init(params)
loss_fn = lambda p: optax.softmax_cross_entropy_with_integer_labels(
    model.apply({"params": p}, x).astype(jnp.float32), y).mean()
grads = jax.grad(loss_fn)(params)
updates, state = opt.update(grads, state, params)
params = optax.apply_updates(params, updates)
print("step applied:", bool(state.last_finite),
      "| skipped so far:", int(state.total_skips),
      "| non-finite gradient elements per path:",
      jmp_lite.nonfinite_paths(state.nonfinite))
origin = jmp_lite.find_nonfinite(
    lambda p: opt.update(jax.grad(loss_fn)(p), state, p)[0], params)
print(origin)"""),
        ("md", """\
No gradient element is non-finite, yet the step was skipped. With a
half-precision optimizer state `loss_scaled` also checks the *updates*
(`check_updates`), and those overflowed. `find_nonfinite` shows why: Adam's
`eps=1e-8` rounds to 0 in float16, so its division produces inf/NaN. Float32
master weights (or `eps=1e-4`) fix it, and without the check the NaNs would
have gone into the params.

Loss scaling fights the opposite problem: small gradients underflowing to
zero in float16. `gradient_health` shows how much underflows at a given
scale, and how many doublings the scale has left before the largest gradient
overflows."""),
        ("code", """\
f32_model = jl.mixed_precision(mlp, "f32")
f32_grads = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
    f32_model.apply({"params": p}, x), y).mean())(jmp_lite.cast_to_full(params))
# Deep nets and summed-over-many-terms losses give far smaller gradients;
# scale these by 1e-5 to see what float16 does to them at each loss scale.
tiny = jax.tree.map(lambda g: g * 1e-5, f32_grads)
for s in (1.0, 2.0 ** 8, 2.0 ** 15):
  h = jmp_lite.gradient_health(tiny, s, jnp.float16)
  under = {jax.tree_util.keystr(p): round(float(v), 4)
           for p, v in jax.tree_util.tree_flatten_with_path(h.underflow)[0]}
  print(f"scale 2**{int(np.log2(s)):2d}: headroom"
        f" {float(h.headroom_bits):5.1f} bits; underflow {under}")"""),
        ("md", """\
Two last checks: matmul shapes that tensor cores dislike, and a dtype the
device runs slowly."""),
        ("code", """\
# A layer of 60 inputs and 10 outputs, as a user might write it:
for m in jmp_lite.check_alignment(lambda x, w: x @ w, jnp.ones((128, 60)),
                                  jnp.ones((60, 10))):
  print(m.primitive, m.dims, "->", m.hint)
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  print(jmp_lite.check_hardware("f16"))"""),
    ],
    "05_pure_bf16": [
        ("md", """\
# Pure bfloat16 training that still learns

Params in bfloat16 with *no* float32 copy: a bfloat16 param of 1.0 ignores
every update below 2**-9, so plain pure bfloat16 Adam stalls once its steps
get small. `jmp_lite.kahan_summation` carries each param's rounding error in
a bfloat16 buffer; `jmp_lite.stochastic_rounding` rounds up or down at
random, unbiased; `jmp_lite.state_dtypes` stores Adam's moments in bfloat16
while Adam computes in float32. The digits MLP, Adam 3e-4, 300 steps:"""),
        ("code", SETUP),
        ("code", """\
lowp = examples.low_precision_optimizer
runs = {
    "float32": ("f32", {}),
    "O2: bf16 + f32 master": ("p=bf16,c=bf16,o=f32", {"master": True}),
    "plain pure bf16": ("bf16", {}),
    "bf16 + Kahan": ("bf16", {"optimizer": lowp("kahan", "bf16")}),
    "bf16 + stochastic rounding": (
        "bf16", {"optimizer": lowp("stochastic", "bf16")}),
}

def quantized(bits):
  # Adam's moments in 8 or 4 bits per element, bf16 params rounded at random.
  return lambda adam, loss_scale: jmp_lite.stochastic_rounding(
      jmp_lite.quantized_states(jmp_lite.loss_scaled(adam, loss_scale),
                                bits=bits))

runs["bf16 + SR, 8-bit states"] = ("bf16", {"optimizer": quantized(8)})
runs["bf16 + SR, 4-bit states"] = ("bf16", {"optimizer": quantized(4)})
results = {name: examples.train_digits(policy, lr=3e-4, steps=300, **kw)
           for name, (policy, kw) in runs.items()}
n_params = results["float32"].param_bytes / 4
print(f"{'run':28} {'eval loss':>9} {'acc':>6} {'bytes/param':>11}")
for name, r in results.items():
  print(f"{name:28} {r.eval_loss:9.4f} {r.accuracy:6.3f}"
        f" {(r.param_bytes + r.state_bytes) / n_params:11.2f}")"""),
        loss_curves("fontsize=7"),
        ("md", """\
Plain pure bfloat16 falls behind as soon as Adam's steps shrink below half
an ulp of the weights; Kahan summation (8 bytes per parameter: param,
compensation, two moments) and stochastic rounding (6 bytes) follow float32,
at less than half of O2's 14 bytes; with Adam's moments block-quantized
(`jmp_lite.quantized_states`, 8 or 4 bits per element) stochastic rounding
holds about 4 (or 3) bytes per parameter and still follows float32. The
`O3` preset builds the Kahan recipe (or, with `compensation="stochastic"`,
the stochastic one; with `state_bits=8`, the quantized one):"""),
        ("code", """\
from jmp_lite.presets import preset

o3 = preset("O3", half="bf16")
opt = o3.optimizer(optax.adam(3e-4))
params = {"w": jnp.zeros((4, 3), jnp.bfloat16)}
state = opt.init(params)
adam = jmp_lite.struct.find_nodes(state, optax.ScaleByAdamState)[0]
print(o3.compensation, jax.tree.map(lambda x: x.dtype.name, {
    "compensation": state.compensation, "mu": adam.mu, "nu": adam.nu}))"""),
    ],
    "06_fp4": [
        ("md", """\
# FP4 training: NVFP4 and MXFP4 against bfloat16

`jmp_lite.fp4.dot_general(recipe, key)` runs a layer's three matmuls on
4-bit (E2M1) operands: 16-element blocks with an E4M3 scale and a tensor
scale (NVFP4, weights in 16x16 tiles, a random Hadamard transform on the
weight gradient, gradients rounded stochastically), or 32-element blocks
with power-of-two scales (MXFP4). The digits MLP's hidden layer runs in FP4,
the first and last layers stay bfloat16, as the NVFP4 recipe keeps its most
sensitive layers high; each step draws a fresh key from the `"fp4"` stream.
Adam 3e-4, 300 steps:"""),
        ("code", SETUP),
        ("code", """\
import flax.linen as nn
from jmp_lite import fp4
import jmp_lite.fp4.linen as fp4_linen

x_tr, y_tr, x_te, y_te = examples.load_digits_split(0)

def train(recipe, steps=300, batch=128):
  fields = {} if recipe is None else fp4_linen.layer_fields(recipe)

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
      x = nn.relu(nn.Dense(128, **kw)(x))
      x = nn.relu(nn.Dense(128, **kw, **fields)(x))  # the FP4 layer
      return nn.Dense(10, **kw)(x)

  model = MLP()
  params = model.init(jax.random.key(0), x_tr[:1])["params"]
  order = np.concatenate([np.random.default_rng(i).permutation(len(x_tr))
                          for i in range(steps * batch // len(x_tr) + 2)])
  def batches(i):
    idx = order[i * batch:(i + 1) * batch]
    return x_tr[idx], y_tr[idx], jax.random.fold_in(jax.random.key(7), i)
  def loss_fn(p, b):
    x, y, key = b
    logits = model.apply({"params": p}, x, rngs={"fp4": key})
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y).mean()
  @jax.jit
  def evaluate(p):
    logits = model.apply({"params": p}, x_te).astype(jnp.float32)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, y_te)
            .mean(), jnp.mean(jnp.argmax(logits, -1) == y_te))
  return examples.fit(params, loss_fn, batches, steps=steps, lr=3e-4,
                      loss_scale=jmp_lite.NoOpLossScale(), master=False,
                      eval_fn=evaluate)

results = {"bf16": train(None), "NVFP4": train(fp4.NVFP4()),
           "MXFP4": train(fp4.MXFP4())}
base = results["bf16"].eval_loss
print(f"{'run':8} {'eval loss':>9} {'vs bf16':>8} {'acc':>6}")
for name, r in results.items():
  print(f"{name:8} {r.eval_loss:9.4f} {r.eval_loss / base - 1:+8.1%}"
        f" {r.accuracy:6.3f}")"""),
        loss_curves(),
        ("md", """\
On a model this small FP4's gap is a few percent of held-out loss (one seed
here; `tests/test_fp4_fidelity.py` averages two and holds NVFP4 within 5%,
MXFP4 within 12%). `docs/fp4.md` has the recipe's ingredients, what runs
natively where, and the char-LM ablation."""),
    ],
}


def build(names=None) -> None:
  for name, cells in NOTEBOOKS.items():
    if names and name not in names:
      continue
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md"
                else nbformat.v4.new_code_cell(src) for kind, src in cells]
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE.parent)}}).execute()
    nbformat.write(nb, HERE / f"{name}.ipynb")
    print("wrote", name)


if __name__ == "__main__":
  build(sys.argv[1:])
