"""The package's layout keeps its architecture: the import graph read from
the code (every ``import``, function-level ones included) has no cycle
between modules or between rooms, and no import runs from a lower room to
a higher one:

    models  <-  data  <-  weights  <-  train / export  <-  the CLIs and faces

(``vit_jax/*.py``). ``import vit_jax.models`` pulls in neither torch nor
TensorFlow."""

import ast
import os
import subprocess

from train_helpers import PYTHON, REPO

PKG = os.path.join(REPO, "vit_jax")
ROOMS = {"models": 0, "data": 1, "weights": 2, "train": 3, "export": 3}
FACES = 4  # vit_jax/*.py: the CLIs and the thin public faces
MAX_TOP_LEVEL_MODULES = 14


def modules():
  """{dotted name: path} of every module of the package."""
  out = {}
  for root, _, files in os.walk(PKG):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(root, f)
        rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return out


def _is_package(name, mods):
  return mods.get(name, "").endswith("__init__.py")


def imports(name, path, mods):
  """The package's modules ``name`` imports (anywhere in the file)."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  base = name if _is_package(name, mods) else name.rsplit(".", 1)[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("vit_jax"):
          found.add(_longest(a.name, mods))
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:
        parts = base.split(".")
        parts = parts[:len(parts) - node.level + 1]
        mod = ".".join(parts + ([mod] if mod else []))
      if not mod.startswith("vit_jax"):
        continue
      for a in node.names:
        sub = f"{mod}.{a.name}"
        found.add(sub if sub in mods else _longest(mod, mods))
  found.discard(name)
  return found


def _longest(dotted, mods):
  parts = dotted.split(".")
  while parts and ".".join(parts) not in mods:
    parts.pop()
  return ".".join(parts)


def room(name):
  parts = name.split(".")
  if len(parts) == 1:
    return "vit_jax", FACES  # the package's own __init__: a face
  if parts[1] in ROOMS:
    return parts[1], ROOMS[parts[1]]
  return "vit_jax", FACES


def graph():
  mods = modules()
  return {n: imports(n, p, mods) for n, p in mods.items()}


def _cycles(g):
  """Strongly connected components with more than one node (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in g.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(g):
    if v not in index:
      visit(v)
  return out


def test_no_import_runs_from_a_lower_room_to_a_higher_one():
  bad = []
  for src, targets in graph().items():
    r_src, level = room(src)
    for dst in targets:
      r_dst, dst_level = room(dst)
      if dst_level > level or (dst_level == level and r_src != r_dst):
        bad.append(f"{src} ({r_src}) -> {dst} ({r_dst})")
  assert not bad, "\n".join(sorted(bad))


def test_no_cycle_between_modules():
  assert _cycles(graph()) == []


def test_no_cycle_between_rooms():
  rooms = {}
  for src, targets in graph().items():
    for dst in targets:
      a, b = room(src)[0], room(dst)[0]
      if a != b:
        rooms.setdefault(a, set()).add(b)
  assert _cycles(rooms) == []


def test_the_top_level_holds_only_the_clis_and_faces():
  top = [f for f in os.listdir(PKG) if f.endswith(".py")]
  assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)
  assert sorted(d for d in os.listdir(PKG) if os.path.isdir(
      os.path.join(PKG, d)) and not d.startswith("__")) == sorted(ROOMS)


def test_models_import_neither_torch_nor_tensorflow():
  code = ("import sys, vit_jax.models; bad = [m for m in ('torch', "
          "'tensorflow', 'tensorflow_datasets', 'timm', 'transformers') if m "
          "in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
  p = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 0, p.stdout + p.stderr[-2000:]
