"""The demo (``python -m jmp_lite``) and the benchmark scripts still run."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jmp_lite import demo

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_all_three_precisions(capsys):
  rows = demo.main(["--steps", "30", "--width", "32", "--batch", "16",
                    "--no-progress"])
  assert [r.name for r in rows] == ["f32", "bf16", "f16"]
  assert [r.policy for r in rows] == ["p=f32,c=f32,o=f32", "p=f32,c=bf16,o=f32",
                                      "p=f32,c=f16,o=f32"]
  assert rows[2].loss_scale == "DynamicLossScale"
  for r in rows:
    assert 0 < r.final_loss < 1.5 and r.ms_per_step > 0
  # Same stored params (float32 master weights) in every run.
  assert len({r.param_bytes for r in rows}) == 1
  out = capsys.readouterr().out
  assert "final loss" in out and "p=f32,c=f16,o=f32" in out
  # Under the table: why half precision is slower here (emulated on CPU);
  # elsewhere what check_hardware says (an H100: nothing).
  table_end = out.index("p=f32,c=f16,o=f32")
  notes = [line for line in out[table_end:].splitlines()
           if line.startswith("note: ")]
  if jax.default_backend() == "cpu":
    # The notes agree with the speed-ups in the table above them.
    assert len(notes) == 2
    for row, note in zip(rows[1:], notes, strict=True):
      name = "bfloat16" if "bf16" in row.policy else "float16"
      speedup = rows[0].ms_per_step / row.ms_per_step
      assert note.startswith(f"note: {name} on the CPU is emulated"), note
      assert f"{speedup:.2f}x" in note, (note, speedup)
      assert ("usually slower" in note) == (speedup < 1), (note, speedup)
  else:   # No CPU note on an accelerator; whatever else it says is shown.
    assert not any("on the CPU" in n for n in notes), notes
    assert notes == [f"note: {m}" for m in demo.hardware_notes(
        [demo.jmp_lite.get_policy(r.policy) for r in rows])]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's note")
def test_cpu_note_follows_the_measured_speedups():
  bf16 = [demo.jmp_lite.get_policy("p=f32,c=bf16,o=f32")]
  (faster,) = demo.hardware_notes(bf16, speedups={"bfloat16": [1.12, 1.36]})
  assert "usually slower" not in faster and "1.12x, 1.36x" in faster
  (slower,) = demo.hardware_notes(bf16, speedups={"bfloat16": [0.7]})
  assert "usually slower" in slower and "(measured here: 0.70x)" in slower
  (unmeasured,) = demo.hardware_notes(bf16)
  assert unmeasured.startswith("bfloat16 on the CPU is emulated and usually")


def test_no_hardware_note_for_float32_only(capsys):
  demo.main(["--steps", "3", "--width", "8", "--batch", "4", "--runs", "f32",
             "--no-progress"])
  assert "note:" not in capsys.readouterr().out


# Seven trainings (15 s); test_demo_trains_all_three_precisions covers the
# default runs in the default set.
@pytest.mark.slow
def test_demo_all_runs_with_progress_bar(capsys):
  rows = demo.main(["--steps", "40", "--width", "16", "--batch", "8",
                    "--runs", *demo.RUNS])
  by = {r.name: r for r in rows}
  err = capsys.readouterr().err
  assert "[" + "#" * 30 + "] 40/40" in err
  # Half params store half the bytes; master weights add a float32 copy.
  assert by["o2-bf16"].param_bytes * 2 == by["f32"].param_bytes
  assert by["o2-bf16"].state_bytes > by["f32"].state_bytes
  assert by["bf16"].activation_bytes < by["f32"].activation_bytes
  for name in ("f32", "bf16", "f16", "o2-bf16", "o2-f16"):
    assert np.isfinite(by[name].final_loss) and by[name].final_loss < 1.5
  # Pure float16 without master weights or loss scaling visibly goes wrong:
  # Adam's eps rounds to 0 in float16 and steps are lost or the loss blows up.
  bad = by["pure-f16"]
  assert bad.skipped > 0 or not np.isfinite(bad.final_loss) or (
      bad.final_loss > 2 * by["f32"].final_loss)


def test_demo_rejects_bad_options():
  with pytest.raises(SystemExit):
    demo.main(["--steps", "0"])
  with pytest.raises(SystemExit):
    demo.main(["--runs", "f8"])


def _run_script(argv: list[str], *, cpu: bool = True,
                devices: int | None = None, timeout: int = 600
                ) -> subprocess.CompletedProcess[str]:
  """Runs ``python argv...`` from the checkout (a benchmark script), on the
  CPU unless ``cpu=False``, with ``devices`` forced host devices; fails the
  test if it exits non-zero."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  if cpu:
    env["JAX_PLATFORMS"] = "cpu"
  if devices is not None:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return subprocess.run([sys.executable, *argv], capture_output=True,
                        text=True, check=True, cwd=ROOT, env=env,
                        timeout=timeout)


def test_python_dash_m_help():
  out = subprocess.run([sys.executable, "-m", "jmp_lite", "--help"],
                       capture_output=True, text=True, check=True, cwd=ROOT)
  assert "float16" in out.stdout and "--steps" in out.stdout


@pytest.mark.slow   # a benchmark script in a subprocess: 14-33 s
def test_loss_scaling_benchmark_runs_small():
  pytest.importorskip("flax")
  out = _run_script(
      ["benchmarks/loss_scaling_overhead.py", "--width", "64",
       "--depth", "2", "--batch", "8", "--steps", "1", "--rounds", "1",
       "--compute", "f32"])
  for row in ("| plain |", "| jmp_lite.update_and_apply |",
              "| loss_scaled.update + apply_updates |", "| Flax DynamicScale |",
              "| optax.apply_if_finite (no scaling) |",
              "| manual jmp-style (jmp_lite) |", "| plain, bf16 compute |"):
    assert out.stdout.count(row) >= 1, row
  assert "f32 compute" in out.stdout and "donated" in out.stdout
  assert "update_and_apply on cpu: cond" in out.stdout


@pytest.mark.slow   # a benchmark script in a subprocess: 14-33 s
def test_gpu_step_benchmark_runs_small_on_cpu():
  out = _run_script(
      ["benchmarks/gpu_step.py", "--width", "32",
       "--depth", "2", "--batch", "8", "--steps", "2", "--rounds", "2",
       "--compute", "f16"])
  rows = {line.split("|")[1].strip(): line.split("|")[2:-1]
          for line in out.stdout.splitlines() if line.startswith("| ")}
  # The conditionals column: the cond formulation keeps one on the CPU.
  assert {name: rows[name][2].strip() for name in (
      "plain", "update_and_apply cond", "update_and_apply select",
      "update cond", "update select")} == {
          "plain": "0", "update_and_apply cond": "1",
          "update_and_apply select": "0", "update cond": "1",
          "update select": "0"}, out.stdout
  # Issue 31's 8-bit recipe runs too (float16 compute, dynamic loss
  # scaling), its guard one cond on the CPU.
  assert out.stdout.count("| 8-bit states + SR, bf16 params |") == 1
  assert rows["8-bit states + SR, bf16 params"][2].strip() == "1"
  assert "f16, update_and_apply: " in out.stdout
  assert "skip_with='auto' compiles to 'cond' here" in out.stdout


@pytest.mark.slow   # a benchmark script in a subprocess: about 30 s
def test_optimizer_memory_benchmark_runs_small():
  out = _run_script(
      ["benchmarks/optimizer_memory.py", "--width", "64",
       "--depth", "2", "--batch", "8", "--steps", "2", "--rounds", "1"])
  rows = {line.split("|")[1].strip(): [float(c) for c in
                                       line.split("|")[2:-1]]
          for line in out.stdout.splitlines()
          if line.startswith("| ")
          and not line.startswith(("| variant", "| ---"))}
  # Columns: pytrees, resident, peak, extra full, extra update, time.
  assert rows["f32 Adam"][:2] == [12.0, 12.0]
  assert rows["pure bf16 Adam"][:2] == [6.0, 6.0]
  assert rows["pure bf16 Adam"][3:5] == [0.0, 0.0]
  assert rows["bf16 + SR"][:2] == [6.0, 6.0]
  # Issue 31: Adam at about 4 (8-bit) and 3 (4-bit) bytes per parameter,
  # by hand and through the O3 preset, held as the pytrees and as the
  # donated step's resident arguments.
  for name, bound in (("bf16 + SR + quantized_states(8 bits)", 4.12),
                      ("preset O3 bf16 state_bits=8", 4.12),
                      ("bf16 + SR + quantized_states(4 bits)", 3.12),
                      ("preset O3 bf16 state_bits=4", 3.12)):
    tree, resident, peak = rows[name][:3]
    assert tree <= bound and resident <= bound, (name, rows[name])
    assert peak >= resident, (name, rows[name])
  # The O3 preset's guard, stepped by update_and_apply, costs its recipe's
  # bytes plus one read of the gradients (the finiteness check; plus a few
  # scalars at this size) in the optimizer step.
  guard = (rows["preset O3 bf16 (Kahan) [update_and_apply]"][4]
           - rows["bf16 + Kahan + state_dtypes(bf16) [update_and_apply]"][4])
  assert 0.9 <= guard <= 1.2, guard


@pytest.mark.slow   # a benchmark script in a subprocess: 14-33 s
def test_policy_overhead_benchmark_runs_small():
  out = _run_script(
      ["benchmarks/policy_overhead.py", "--width", "32",
       "--depth", "2", "--batch", "8", "--steps", "2", "--rounds", "1",
       "--model-dim", "32", "--seq", "8", "--seq-batch", "2",
       "--lower-layers", "2", "--lower-dim", "32", "--lower-repeats", "1"],
      cpu=False)
  assert "jmp_lite policy" in out.stdout and "Residuals" in out.stdout
  assert "bfloat16, remat_norms" in out.stdout
  assert "first lowering" in out.stdout and "later, wall-clock" in out.stdout
  assert "| jmp_lite policy, cache_traces=False |" in out.stdout


@pytest.mark.slow   # a benchmark script in a subprocess: 14-33 s
def test_autocast_benchmark_runs_small():
  out = _run_script(
      ["benchmarks/autocast_overhead.py", "--width", "32",
       "--depth", "2", "--batch", "8", "--steps", "2", "--rounds", "1"],
      cpu=False)
  assert "jmp_lite.autocast" in out.stdout and "Time to lower" in out.stdout
  # The by-hand baseline places every cast where autocast does: one program.
  rows = {line.split("|")[1].strip(): line.split("|")[2:4]
          for line in out.stdout.splitlines()
          if line.startswith(("| jmp_lite.autocast |", "| cast by hand |"))}
  assert rows["jmp_lite.autocast"] == rows["cast by hand"], rows


def test_progress_writes_plain_lines_when_not_a_terminal():
  """A redirected log got carriage returns: one line of 40 bars."""
  class Log(io.StringIO):
    def isatty(self):
      return False

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  log, tty = Log(), Terminal()
  for i in range(41):
    demo._progress(log, "f32", i, 40)
    demo._progress(tty, "f32", i, 40)
  lines = log.getvalue().splitlines()
  assert "\r" not in log.getvalue()
  assert [line.split()[-1] for line in lines] == [
      "0/40", "10/40", "20/40", "30/40", "40/40"]
  assert tty.getvalue().count("\r") == 41 and tty.getvalue().endswith("\n")


@pytest.mark.slow
def test_multi_gpu_benchmark_runs_small_on_host_devices():
  out = _run_script(
      ["benchmarks/multi_gpu_step.py", "--width", "64",
       "--depth", "2", "--batch", "16", "--steps", "1", "--rounds", "1"],
      devices=4)
  assert out.stdout.startswith("4 x cpu"), out.stdout
  for layout in ("dp", "fsdp"):
    assert f"{layout}: loss scaling adds" in out.stdout
  # Data parallel: the gradients' all-reduce already tells every device
  # about an inf; the skip adds no collective.
  assert "dp: loss scaling adds none" in out.stdout
  assert out.stdout.count("| loss-scaled update_and_apply |") == 2


@pytest.mark.slow
def test_fp8_gather_bytes_benchmark_runs_small_on_host_devices():
  out = _run_script(
      ["benchmarks/fp8_gather_bytes.py", "--width", "512",
       "--depth", "2", "--batch", "16"],
      devices=4)
  assert out.stdout.startswith("4 x cpu"), out.stdout
  rows = {}
  for line in out.stdout.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) == 7 and cells[0] in ("bf16", "fp8 tensor", "fp8 row",
                                        "fp8 block", "fp8 mx"):
      rows[cells[0]] = cells
  assert len(rows) == 5, out.stdout
  # Two 512x512 bf16 weights gathered once each: 2 * 512 * 512 * 2 bytes.
  assert rows["bf16"][1:4] == ["1048576", "0", "1048576"]
  assert rows["bf16"][5] == "bf16"
  for name in ("fp8 tensor", "fp8 row", "fp8 block", "fp8 mx"):
    payload, scales, total = (int(c) for c in rows[name][1:4])
    assert payload == 2 * 512 * 512, (name, rows[name])
    assert total == payload + scales
    assert float(rows[name][4].rstrip("x")) <= 0.55, rows[name]
    assert rows[name][5] == "f32", rows[name]  # the gradient's scatter
  assert rows["fp8 tensor"][2] == "0"
  assert int(rows["fp8 row"][2]) == 2 * 512 * 4  # a float32 per row
  assert int(rows["fp8 mx"][2]) == 2 * 512 * 512 // 32  # a byte per block
  # block: one float32 scale per 128 x 128 tile.
  assert int(rows["fp8 block"][2]) == 2 * (512 // 128) ** 2 * 4


@pytest.mark.slow
def test_gpu_fp8_benchmark_runs_each_granularity_small_on_cpu():
  out = _run_script(
      ["benchmarks/gpu_fp8.py", "--width", "32", "--seq", "8",
       "--heads", "2", "--batch", "1", "--steps", "1", "--rounds", "1"])
  rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
          if line.startswith(("bf16 ", "fp8-"))}
  # Row, block and MX: FP8 operands in the same 12 dots as per tensor (4
  # projections x forward, d-input, d-weight), a time against bf16's.
  for name in ("fp8-row", "fp8-block", "fp8-mx"):
    assert rows[name][1:3] == ["12", "0/0"], out.stdout
    assert rows[name][-1].endswith("x") and float(rows[name][-1][:-1]) > 0
  assert rows["bf16"][-1] == "1.00x"


@pytest.mark.slow
def test_fp8_native_probe_runs_small_on_cpu():
  out = _run_script(
      ["benchmarks/fp8_native_probe.py", "--size", "64",
       "--steps", "1", "--rounds", "1"], timeout=300)
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")]
          for line in out.stdout.splitlines() if line.startswith("| ")}
  for name in ("jmp_lite MXFP8", "jmp_lite row", "jmp_lite block"):
    assert rows[name][2] == "yes", out.stdout
    assert 0.01 < float(rows[name][5]) < 0.1, rows[name]  # E4M3's error.
  # JAX's own MX matmul either runs or says why not.
  assert rows["jax.nn mxfp8 (default)"][2].startswith(("yes", "no: "))


@pytest.mark.slow
def test_fp8_granularity_plot_runs(tmp_path):
  pytest.importorskip("matplotlib")
  out = _run_script(
      ["benchmarks/fp8_granularity_plot.py", "--out",
       str(tmp_path / "plot.png")], timeout=300)
  medians = {line[:12].strip(): float(line.split()[-1])
             for line in out.stdout.splitlines() if "median" in line}
  assert set(medians) == {"per tensor", "per row", "block 128", "MXFP8 (32)"}
  for fine in ("per row", "block 128", "MXFP8 (32)"):
    assert medians[fine] < medians["per tensor"] / 5, medians
  assert (tmp_path / "plot.png").stat().st_size > 10_000


@pytest.mark.slow
def test_quantized_step_cost_benchmark_runs_small_on_cpu():
  out = _run_script(
      ["benchmarks/quantized_step_cost.py", "--width", "64",
       "--depth", "2", "--batch", "8", "--steps", "1", "--rounds", "1",
       "--xla-path", "--only", "adam, 8));quantized_adam(8"])
  rows = {cells[1]: cells[2:-1] for cells in (
      [c.strip() for c in line.split("|")] for line in out.stdout.splitlines()
      if line.startswith(("| SR(", "| UAA")))}
  # --only runs the chosen rows and the baseline they need, nothing else.
  assert set(rows) == {
      "SR(adam)", "SR(quantized_states(adam, 8))", "SR(quantized_adam(8))",
      "SR(quantized_adam(8, xla))", "UAA SR(loss_scaled(adam))",
      "UAA SR(loss_scaled(quantized_adam(8)))",
      "UAA SR(loss_scaled(quantized_adam(8, xla)))"}, out.stdout
  base = [float(c) for c in rows["SR(adam)"]]
  # bytes, ratio, flops, ratio, ops each once, ratio, fusions, opt ms,
  # ratio, full ms, ratio.
  assert len(base) == 11 and all(base[i] == 1.0 for i in (1, 3, 5, 8, 10))
  # kernel="xla" is quantized_states' XLA path: the same cost.
  assert rows["SR(quantized_adam(8, xla))"][:6] == rows[
      "SR(quantized_states(adam, 8))"][:6]
  # The C++ kernel's flops are outside XLA's model (said so); its bytes are
  # counted, and fewer than the XLA path's.
  kernel = rows["SR(quantized_adam(8))"]
  assert kernel[2].endswith("+ kernel") and kernel[3].endswith("+ kernel")
  # Its operations are counted as its XLA twin's, which it computes.
  assert kernel[4:6] == rows["SR(quantized_adam(8, xla))"][4:6]
  assert 1.0 < float(kernel[5]) < 3.0
  assert float(kernel[0]) < float(rows["SR(quantized_adam(8, xla))"][0])
  assert rows["UAA SR(loss_scaled(quantized_adam(8)))"][2].endswith(
      "+ kernel")


@pytest.mark.slow
def test_block_gemm_benchmark_runs_the_kernel_interpreted_on_cpu():
  out = _run_script(
      ["benchmarks/fp8_block_gemm.py", "--tokens", "32",
       "--width", "128", "--rounds", "1"])
  rows = [[c.strip() for c in line.split("|")[1:-1]]
          for line in out.stdout.splitlines() if line.startswith("| ")
          and "---" not in line and "variant" not in line]
  names = [r[0] for r in rows]
  # Two shapes, each: bf16, the two references and the interpreted kernel.
  assert names == ["bf16", "fp8 per-tensor", "looped_dot",
                   "kernel e4m3 (interpreter)"] * 2, out.stdout
  assert all(float(r[3]) > 0 for r in rows)
