"""A clean first screen: TensorFlow's native INFO lines never reach the user,
warnings and errors (native or Python) always do; every CLI starts with our
own lines."""

import os
import subprocess

import train_helpers
from train_helpers import PYTHON, REPO, tiny_overrides, train_cmd
from vit_jax.data import console

NOISE = [
    b"WARNING: All log messages before absl::InitializeLog() is called are "
    b"written to STDERR\n",
    b"I0000 00:00:1795463825.599104    8158 port.cc:153] oneDNN custom "
    b"operations are on. You may see slightly different numerical results\n",
    b"I0000 00:00:1795463825.627419    8158 cpu_feature_guard.cc:227] This "
    b"TensorFlow binary is optimized to use available CPU instructions\n",
    b"To enable the following instructions: AVX2 AVX512F FMA, in other "
    b"operations, rebuild TensorFlow with the appropriate compiler flags.\n",
    b"I1123 19:57:10.591067    8194 tf_record_dataset_op.cc:396] The default "
    b"buffer size is 262144\n",
]
KEPT = [
    b"W0000 00:00:1795463946.827734    8435 cache_dataset_ops.cc:912] The "
    b"calling iterator did not fully read the dataset being cached.\n",
    b"E1123 20:16:57.223591   18332 coordination_service_agent.cc:289] Polled "
    b"an error from coordination service\n",
    b"WARNING:absl:Variant folder digits/1.0.0 has no dataset_info.json\n",
    b"train.py: error: unknown config field 'nope'\n",
]
MARKERS = ("oneDNN custom operations", "cpu_feature_guard",
           "absl::InitializeLog", "tf_record_dataset_op", "I0000 ")


def test_noise_and_what_is_kept():
  assert all(console.is_noise(line) for line in NOISE)
  assert not any(console.is_noise(line) for line in KEPT)


def test_filtered_block_replays_all_but_noise():
  code = (
      "import os, sys, warnings\n"
      "from vit_jax import console\n"
      "with console.native_stderr_filtered():\n"
      f"  for line in {NOISE + KEPT!r}:\n"
      "    os.write(2, line)\n"
      "  warnings.warn_explicit('a Python warning', UserWarning, 'x.py', 1)\n"
      "  print('a Python error line', file=sys.stderr)\n")
  p = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True,
                     text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  assert not any(m in p.stderr for m in MARKERS), p.stderr
  for line in KEPT:
    assert line.decode() in p.stderr
  assert "x.py:1: UserWarning: a Python warning" in p.stderr
  assert "a Python error line" in p.stderr


def _quiet_env():
  e = train_helpers.env()
  e.pop("TF_CPP_MIN_LOG_LEVEL")  # what a user has: nothing set
  return e


def _run(cmd):
  p = subprocess.run(cmd, cwd=REPO, env=_quiet_env(), capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  assert not any(m in p.stderr for m in MARKERS), p.stderr[:3000]
  return p


def test_every_cli_starts_with_our_own_lines(tmp_path):
  run = tmp_path / "run"
  p = _run(train_cmd(str(run), tiny_overrides(total_steps=2, log_every=1,
                                              eval_every=2,
                                              checkpoint_every=2)))
  assert p.stdout.startswith("vit_ti_4 (10,698 params) on digits"), p.stdout
  image = os.path.join(REPO, "docs", "images", "inputs",
                       "digits_test13_label2.png")
  p = _run([PYTHON, "-m", "vit_jax.evaluate", "--checkpoint", str(run)])
  assert p.stdout.startswith("digits[test]: top-1 "), p.stdout
  p = _run([PYTHON, "-m", "vit_jax.predict", "--checkpoint", str(run), image])
  assert p.stdout.startswith(f"== {run}: vit_jax training checkpoint")
  p = _run([PYTHON, "-m", "vit_jax.visualize", "--checkpoint", str(run),
            "--out", str(tmp_path / "pictures"), image])
  assert p.stdout.startswith(str(tmp_path / "pictures"))
  feats = str(tmp_path / "feats.npz")
  p = _run([PYTHON, "-m", "vit_jax.features", "--checkpoint", str(run),
            "--out", feats])
  assert p.stdout.startswith(feats), p.stdout
  p = _run([PYTHON, "-m", "vit_jax.probe", "--train", feats, "--test", feats,
            "--no-linear"])
  assert p.stdout.startswith("k-NN") or "k-NN" in p.stdout.splitlines()[1]
  p = _run([PYTHON, "-m", "vit_jax.export", "--checkpoint", str(run),
            "--format", "stablehlo", "--out", str(tmp_path / "m.shlo")])
  assert p.stdout.startswith("wrote "), p.stdout
  for cmd in (["bench/bench.py", "--help"], ["bench/ab.py", "--help"]):
    p = _run([PYTHON] + cmd)
    assert p.stdout.startswith("usage: ") and p.stderr == ""


def test_the_main_job_prepares_the_bundled_digits_in_one_line(tmp_path):
  """A fresh machine: tfds' notices and progress bars for the dataset we
  ship ("Variant folder ... has no dataset_info.json", "Downloading and
  preparing dataset Unknown size") give way to one line of ours."""
  o = tiny_overrides(total_steps=2, log_every=1, eval_every=2,
                     checkpoint_every=2, data_dir=str(tmp_path / "tfds"))
  p = _run(train_cmd(str(tmp_path / "run"), o))
  first, second = p.stdout.splitlines()[:2]
  assert first == (f"Preparing the bundled 'digits' dataset in "
                   f"{tmp_path / 'tfds' / 'digits' / '1.0.0'} (once; nothing "
                   f"is downloaded)."), p.stdout
  assert second.startswith("vit_ti_4 (10,698 params) on digits"), p.stdout
  for noise in ("Variant folder", "dataset_info.json", "Downloading and "
                "preparing", "Generating", "Shuffling", "Unknown size"):
    assert noise not in p.stdout + p.stderr, p.stdout + p.stderr
  # Prepared once: the next run says nothing about it.
  p = _run(train_cmd(str(tmp_path / "run2"), o))
  assert p.stdout.startswith("vit_ti_4 (10,698 params) on digits"), p.stdout


def test_a_library_asking_whether_tensorflow_exists_does_not_use_up_the_filter():
  """Some libraries probe ``importlib.util.find_spec('tensorflow')``
  without importing it; the real import after that is still filtered.
  Keras' optimizers are not imported with TensorFlow, and load with Keras
  when the program imports it."""
  code = (
      "import importlib.util, sys\n"
      "from vit_jax.data import console\n"
      "console.quiet_native_logs()\n"
      "assert importlib.util.find_spec('tensorflow') is not None\n"
      "import tensorflow\n"
      "assert 'keras.src.optimizers' not in sys.modules\n"
      "assert not any(type(f).__module__ == console.__name__\n"
      "               for f in sys.meta_path), sys.meta_path\n"
      "import keras\n"
      "assert keras.optimizers.Adam(0.1).learning_rate == 0.1\n"
      "assert tensorflow.keras.optimizers.SGD is keras.optimizers.SGD\n"
      "print('imported', file=sys.stderr)\n")
  p = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=_quiet_env(),
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  assert "imported" in p.stderr
  assert not any(m in p.stderr for m in MARKERS), p.stderr


def test_a_cli_prints_a_warning_as_one_line(tmp_path):
  """A bare file's GuessWarning in a CLI: one line, `warning: <message>`,
  not Python's `file.py:80: GuessWarning:` and a line of our source."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from vit_jax import formats, models  # pylint: disable=import-outside-toplevel
  model = models.get_model("vit_ti_16", num_layers=1, num_classes=3)
  variables = models.init_params(model, 32)
  ckpt = str(tmp_path / "bare.safetensors")  # no preprocessing recorded
  formats.save_safetensors(variables, ckpt, model=model)
  Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "x.png")
  p = _run([PYTHON, "-m", "vit_jax.predict", "--checkpoint", ckpt,
            str(tmp_path / "x.png")])
  lines = p.stderr.splitlines()
  said = [l for l in lines if "does not say how images must be prepared" in l]
  assert len(said) == 1 and said[0].startswith(f"warning: {ckpt}: "), lines
  assert not any(".py:" in l or "GuessWarning" in l for l in lines), lines


def test_lean_start_up_sets_aside_only_what_start_up_keeps():
  """Survivors of a full collection during start-up are set aside from
  later ones; after start_up_done, cyclic garbage is collected again."""
  code = (
      "import gc, weakref\n"
      "from vit_jax.data import console\n"
      "class Node: pass\n"
      "def cycle():\n"
      "  a, b = Node(), Node(); a.b, b.a = b, a\n"
      "  return a\n"
      "gc.collect(); gc.unfreeze()\n"
      "console.lean_start_up(); console.lean_start_up()\n"
      "assert gc.callbacks.count(console._set_aside_survivors) == 1\n"
      "kept = cycle(); gc.collect()\n"
      "assert gc.get_freeze_count() > 0\n"
      "console.start_up_done()\n"
      "assert console._set_aside_survivors not in gc.callbacks\n"
      "frozen = gc.get_freeze_count()\n"
      "later = weakref.ref(cycle()); gc.collect()\n"
      "assert later() is None, 'cyclic garbage after start-up is collected'\n"
      "assert gc.get_freeze_count() == frozen\n"
      "print('ok')\n")
  p = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True,
                     text=True, timeout=120, env=train_helpers.env())
  assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
