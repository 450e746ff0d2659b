"""The table-driven mapper between a PyTorch-style state dict and our tree.

A layout (:mod:`vit_jax.weights.layouts`) is a list of rows: *their key
pattern*, *our path(s)*, and an :class:`Op` saying how the tensor maps
(a torch Linear's transposed weight, a conv's OIHW kernel, q/k/v fused in
one tensor, ...). Patterns hold ``{i}``-style placeholders for layer indices
(``{s+1}``: the index plus one, where one side counts from 1).
From the one table come both directions and the list of keys a model
expects, so they cannot drift apart:

* :func:`to_ours`: their state dict -> our flat tree (and the keys no row
  claims);
* :func:`to_theirs`: our flat tree -> their state dict, in the table's order
  (which is the library's own ``state_dict()`` order);
* :func:`expected`: our flat *shapes* (the model's ``eval_shape`` tree) ->
  their keys and shapes, for the one checker.

A tensor of ours may be several of theirs (a packed gated MLP's
``Dense_0`` is transformers' ``gate_proj`` and ``up_proj``): each of those
rows holds a :func:`part` op, and the parts are joined on the way in.

Our flat paths name the collection first (``params/embedding/kernel``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax.weights import trees

# --------------------------------------------------------------------------- #
# How one of their tensors relates to ours.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Op:
  """``to_ours(x, num_heads) -> [ours...]``; ``to_theirs([ours...]) -> x``;
  ``shape([our shapes...]) -> their shape``."""

  name: str
  to_ours: Callable[[np.ndarray, int], List[np.ndarray]]
  to_theirs: Callable[[List[np.ndarray]], np.ndarray]
  shape: Callable[[List[Tuple[int, ...]]], Tuple[int, ...]]
  part: Optional[Tuple[int, int, int]] = None  # (index, count, our axis)


def _t(s):
  return tuple(s)[::-1]


RAW = Op("raw", lambda x, h: [x], lambda o: o[0], lambda s: tuple(s[0]))
# torch Linear weight (out, in) <-> linen Dense kernel (in, out).
DENSE = Op("dense", lambda x, h: [x.T], lambda o: o[0].T, lambda s: _t(s[0]))
# torch Conv2d weight (O, I, kh, kw) <-> linen Conv kernel (kh, kw, I, O).
CONV = Op("conv", lambda x, h: [x.transpose(2, 3, 1, 0)],
          lambda o: o[0].transpose(3, 2, 0, 1),
          lambda s: (s[0][3], s[0][2], s[0][0], s[0][1]))
# torch Linear (H*hd, D) <-> our query/key/value kernel (D, H, hd).
HEADS = Op("heads", lambda x, h: [x.T.reshape(x.shape[1], h, -1)],
           lambda o: o[0].reshape(o[0].shape[0], -1).T,
           lambda s: (s[0][1] * s[0][2], s[0][0]))
HEADS_BIAS = Op("heads_bias", lambda x, h: [x.reshape(h, -1)],
                lambda o: o[0].reshape(-1), lambda s: (s[0][0] * s[0][1],))
# torch Linear (D, H*hd) <-> our out kernel (H, hd, D).
OUT = Op("out", lambda x, h: [x.T.reshape(h, -1, x.shape[0])],
         lambda o: o[0].reshape(-1, o[0].shape[-1]).T,
         lambda s: (s[0][2], s[0][0] * s[0][1]))


def _in_proj_split(x, width: int):
  """timm's ``in_proj`` rows (MLP hidden, q, k, v) of a model of
  ``width``: the four parts (the MLP's is the rest)."""
  mlp = x.shape[0] - 3 * width
  if mlp <= 0:
    raise ValueError(f"{x.shape[0]} rows are no MLP + 3 x {width}")
  return np.split(x, [mlp, mlp + width, mlp + 2 * width])


def _in_proj_to_ours(x, h):
  mlp, q, k, v = _in_proj_split(x, x.shape[1])
  return [mlp.T] + [HEADS.to_ours(t, h)[0] for t in (q, k, v)]


def _in_proj_bias_to_ours(x, heads_width):
  h, width = heads_width
  mlp, q, k, v = _in_proj_split(x, width)
  return [mlp] + [t.reshape(h, -1) for t in (q, k, v)]


# timm's ParallelScalingBlock ``in_proj`` (MLP hidden + 3 x D, D): the MLP's
# first layer and q, k, v in one torch Linear <-> our MlpBlock_0/Dense_0
# kernel (D, hidden) and query / key / value kernels (D, H, hd); its bias
# (the rows' split needs the width: the row's heads are ``'heads_width'``,
# (heads, width)) <-> Dense_0's bias and the q / k / v biases (H, hd).
IN_PROJ = Op(
    "in_proj", _in_proj_to_ours,
    lambda o: np.concatenate([o[0].T] + [HEADS.to_theirs([t]) for t in o[1:]]),
    lambda s: (s[0][1] + 3 * s[1][1] * s[1][2], s[0][0]))
IN_PROJ_BIAS = Op(
    "in_proj_bias", _in_proj_bias_to_ours,
    lambda o: np.concatenate([o[0]] + [t.reshape(-1) for t in o[1:]]),
    lambda s: (s[0][0] + 3 * s[1][0] * s[1][1],))


def _fused_out_to_ours(x, h):
  width = x.shape[0]
  return [OUT.to_ours(x[:, :width], h)[0], x[:, width:].T]


# timm's fused output projection of a parallel block (``out_proj``: D, D +
# hidden, over [attention, MLP]) <-> our attention's out kernel (H, hd, D)
# and MlpBlock_0/Dense_1's (hidden, D).
FUSED_OUT = Op(
    "fused_out", _fused_out_to_ours,
    lambda o: np.concatenate([OUT.to_theirs([o[0]]), o[1].T], axis=1),
    lambda s: (s[0][2], s[0][0] * s[0][1] + s[1][0]))


def _patch_side(k: int) -> Tuple[int, int]:
  """(patch side, channels) of a flattened (P, P, C) patch of ``k`` values:
  3 channels (RGB) where ``k / 3`` is a square, else 1."""
  for c in (3, 1):
    if k % c == 0:
      p = int(round(np.sqrt(k // c)))
      if p * p * c == k:
        return p, c
  raise ValueError(f"{k} inputs are not a square patch of 3 (or 1) "
                   f"channels")


def _linear_patch_to_ours(x, h):
  del h
  p, c = _patch_side(x.shape[1])
  return [x.T.reshape(p, p, c, x.shape[0])]


# torch Linear (D, P*P*C) on pre-cut (y, x, channel) patches (timm's
# NaFlexVit ``embeds.proj``, transformers' Siglip2 ``patch_embedding``) <->
# our patch-embedding kernel (P, P, C, D): the same numbers as a conv.
LINEAR_PATCH = Op(
    "linear_patch", _linear_patch_to_ours,
    lambda o: o[0].reshape(-1, o[0].shape[-1]).T,
    lambda s: (s[0][3], s[0][0] * s[0][1] * s[0][2]))


def _rows_to_grid(x, h):
  del h
  side = int(round(np.sqrt(x.shape[0])))
  if side * side != x.shape[0]:
    raise ValueError(f"{x.shape[0]} position rows are not a square grid")
  return [x.reshape(1, side, side, x.shape[1])]


# Position rows (H*W, D) of a square grid (transformers' Siglip2
# ``position_embedding.weight``) <-> our NaFlex ``pos_grid`` (1, H, W, D).
GRID_ROWS = Op("grid_rows", _rows_to_grid,
               lambda o: o[0].reshape(-1, o[0].shape[-1]),
               lambda s: (s[0][1] * s[0][2], s[0][3]))


def _square_side(n: int) -> int:
  side = int(round(np.sqrt(n)))
  if side * side != n:
    raise ValueError(f"{n} position rows are not a square grid")
  return side


# A (1, H, W, D) position grid (timm's SAM ``pos_embed``) <-> our patch
# rows (1, H*W, D), row-major; back to theirs as a square.
GRID_TOKENS = Op(
    "grid_tokens", lambda x, h: [x.reshape(1, -1, x.shape[-1])],
    lambda o: o[0].reshape(1, _square_side(o[0].shape[1]), -1,
                           o[0].shape[-1]),
    lambda s: (1, _square_side(s[0][1]), _square_side(s[0][1]), s[0][2]))


def fused(op: Op, n: int) -> Op:
  """``n`` of ours concatenated along their first axis (timm's ``qkv``,
  torchvision's ``in_proj_weight``, the MAP head's ``kv``)."""
  def to_ours(x, h):
    if x.shape[0] % n:
      raise ValueError(f"first axis {x.shape[0]} is not divisible by {n}")
    return [op.to_ours(part, h)[0] for part in np.split(x, n, axis=0)]

  def shape(s):
    one = [op.shape([si]) for si in s]
    return (sum(o[0] for o in one),) + tuple(one[0][1:])
  return Op(f"fused{n}({op.name})", to_ours,
            lambda o: np.concatenate([op.to_theirs([x]) for x in o]), shape)


def part(op: Op, index: int, count: int, axis: int = -1) -> Op:
  """Theirs is part ``index`` of ``count`` equal slices of ours along
  ``axis`` (in our layout): transformers' ``gate_proj`` / ``up_proj`` of a
  packed gated MLP. The slices are joined in order on the way in."""
  def take(o):
    n = o.shape[axis] // count
    return np.take(o, np.arange(index * n, (index + 1) * n), axis=axis)

  def shape(s):
    s = list(s[0])
    s[axis] //= count
    return op.shape([tuple(s)])
  return Op(f"part{index}/{count}({op.name})", op.to_ours,
            lambda o: op.to_theirs([take(o[0])]), shape,
            part=(index, count, axis))


def expand(k: int) -> Op:
  """Theirs without ``k`` leading unit axes (Hugging Face CLIP's
  ``class_embedding`` (D,) for our ``cls`` (1, 1, D))."""
  return Op(f"expand{k}", lambda x, h: [x.reshape((1,) * k + x.shape)],
            lambda o: o[0].reshape(o[0].shape[k:]), lambda s: tuple(s[0][k:]))


def const(value) -> Op:
  """A tensor of theirs with nothing of ours behind it (BatchNorm's
  ``num_batches_tracked``): dropped on the way in, ``value`` on the way out.
  The row's own path is only the anchor that says whether it exists."""
  value = np.asarray(value)
  return Op("const", lambda x, h: [], lambda o: value.copy(),
            lambda s: value.shape)


def zeros(shape_of) -> Op:
  """A tensor of theirs we do not keep (DINOv2's mask token, used only in
  masked-image training): dropped on the way in, zeros of
  ``shape_of(anchor's shape)`` on the way out."""
  return Op("zeros", lambda x, h: [],
            lambda o: np.zeros(shape_of(o[0].shape), np.float32),
            lambda s: tuple(shape_of(s[0])))


# --------------------------------------------------------------------------- #
# Rows and layouts.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Row:
  """``theirs`` <-> ``ours`` by ``op``. ``when`` (on our flat tree) says
  whether the row is written out (None: whenever its paths exist; two rows
  of ours written under different names say which is whose); ``heads`` names the head count
  a multi-head op splits by (``'model'``, or ``'map'`` for a MAP head with
  its own)."""

  theirs: str
  ours: Tuple[str, ...]
  op: Op = RAW
  when: Optional[Callable[[Mapping[str, Any]], bool]] = None  # on our tree
  heads: str = "model"


@dataclasses.dataclass(frozen=True)
class Repeat:
  """Rows repeated for every index of a placeholder (the blocks): their
  keys come out index by index, as in the library's ``state_dict()``
  (several placeholders, e.g. a ResNet's ``{s}`` stage and ``{u}`` unit:
  nested in the alphabetical order of their names)."""

  rows: Tuple[Row, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
  """A PyTorch-side naming of our tree.

  ``aliases``: (regex, replacement) applied to incoming keys (legacy names,
  wrapper prefixes); ``chunks``: (regex, (replacement, ...)) for an incoming
  tensor that is several of the layout's, split along its first axis
  (transformers' Hub files keep DINOv2's SwiGLU ``weights_in``, which its
  models load as ``gate_proj`` and ``up_proj``); ``unsupported``: key fragments of features we do not
  have, with what they are (named in the error); ``dropped``: (regex,
  what) of keys of a second network beside the encoder (ViTMAE's
  pretraining decoder), left out of a load with a warning naming what they
  are (:func:`dropped`), where ``ignored`` keys (another tower) are left
  out silently; ``fixed``: model fields
  every model of the layout has (torchvision's ViT always has a class
  token), which a damaged state dict must not change.
  """

  name: str
  rows: Tuple[Any, ...]
  aliases: Tuple[Tuple[str, str], ...] = ()
  chunks: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
  unsupported: Tuple[Tuple[str, str], ...] = ()
  fixed: Tuple[Tuple[str, Any], ...] = ()
  ignored: str = ""  # regex of keys that are not the image tower's
  dropped: Tuple[Tuple[str, str], ...] = ()
  # How the library resamples a position embedding loaded at another size
  # (vit_jax.weights.posemb.resample_posemb's ``method``).
  resample: str = "torchvision"

  def flat_rows(self) -> List[Row]:
    out = []
    for r in self.rows:
      out.extend(r.rows if isinstance(r, Repeat) else [r])
    return out


def dense(theirs: str, ours: str, bias: bool = True, op: Op = DENSE) -> Tuple[Row, ...]:
  """A torch Linear ``{theirs}weight/bias`` <-> linen ``{ours}/kernel,bias``."""
  rows = (Row(theirs + "weight", (ours + "/kernel",), op),)
  if bias:
    rows += (Row(theirs + "bias", (ours + "/bias",)),)
  return rows


def norm(theirs: str, ours: str) -> Tuple[Row, ...]:
  """A torch LayerNorm ``weight/bias`` <-> linen ``scale/bias``."""
  return (Row(theirs + "weight", (ours + "/scale",)),
          Row(theirs + "bias", (ours + "/bias",)))


def conv(theirs: str, ours: str) -> Tuple[Row, ...]:
  return dense(theirs, ours, op=CONV)


def fused_qkv(theirs_w: str, theirs_b: str, ours: str,
              names=("query", "key", "value")) -> Tuple[Row, ...]:
  """q, k, v (or k, v) stacked in one torch tensor pair."""
  n = len(names)
  return (Row(theirs_w, tuple(f"{ours}/{q}/kernel" for q in names),
              fused(HEADS, n)),
          Row(theirs_b, tuple(f"{ours}/{q}/bias" for q in names),
              fused(HEADS_BIAS, n)))


def split_qkv(theirs: str, ours: str, names=("query", "key", "value")
              ) -> Tuple[Row, ...]:
  """Separate torch Linears ``{theirs}{q}.weight`` for each of q, k, v."""
  rows: Tuple[Row, ...] = ()
  for them, us in zip(names, ("query", "key", "value")):
    rows += (Row(f"{theirs}{them}.weight", (f"{ours}/{us}/kernel",), HEADS),
             Row(f"{theirs}{them}.bias", (f"{ours}/{us}/bias",), HEADS_BIAS))
  return rows


def out_proj(theirs: str, ours: str) -> Tuple[Row, ...]:
  return dense(theirs, ours + "/out", op=OUT)


# --------------------------------------------------------------------------- #
# The mapper.
# --------------------------------------------------------------------------- #

# ``{i}``: a layer index, the same number on both sides; ``{s+1}``: that
# index plus an offset (Google counts ResNet stages and units from 1, timm
# from 0).
_PLACEHOLDER = re.compile(r"\{(\w+)(?:\+(\d+))?\}")


class _Pattern:
  """A key pattern: ``match(key)`` -> the placeholders' indices (offsets
  taken off; None when the key does not match)."""

  def __init__(self, pattern: str):
    # The text before the first placeholder: a key without it is rejected
    # by ``str.startswith`` (a table's rows x a model's keys are millions
    # of tries when every timm name's tables are made).
    first = _PLACEHOLDER.search(pattern)
    self.prefix = pattern[:first.start()] if first else pattern
    parts, pos, self.offsets = [], 0, {}
    for m in _PLACEHOLDER.finditer(pattern):
      parts.append(re.escape(pattern[pos:m.start()]))
      parts.append(f"(?P<{m.group(1)}>\\d+)")
      self.offsets[m.group(1)] = int(m.group(2) or 0)
      pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    self.rx = re.compile("^" + "".join(parts) + "$")

  def match(self, key: str) -> Optional[Dict[str, int]]:
    if not key.startswith(self.prefix):
      return None
    m = self.rx.match(key)
    if m is None:
      return None
    b = {k: int(v) - self.offsets[k] for k, v in m.groupdict().items()}
    return None if any(v < 0 for v in b.values()) else b


def _fill(pattern: str, bindings: Mapping[str, int]) -> str:
  return _PLACEHOLDER.sub(
      lambda m: str(int(bindings[m.group(1)]) + int(m.group(2) or 0)),
      pattern)


@functools.lru_cache(maxsize=None)
def _pattern(text: str) -> _Pattern:
  """The tables' patterns are a few hundred fixed strings: each compiled
  once."""
  return _Pattern(text)


def unmatched(layout: Layout, keys) -> List[str]:
  """The keys no row of the layout claims."""
  rxs = [_pattern(r.theirs) for r in layout.flat_rows()]
  return [k for k in keys if not any(rx.match(k) is not None for rx in rxs)]


def canonical(layout: Layout, state_dict: Mapping[str, Any]) -> Dict[str, Any]:
  """The layout's aliases applied to the keys; other towers' keys (a CLIP
  checkpoint's text model) left out."""
  out = {}
  for k, v in state_dict.items():
    for pat, rep in layout.aliases:
      k = re.sub(pat, rep, k)
    if layout.ignored and re.search(layout.ignored, k):
      continue
    if any(re.search(pat, k) for pat, _ in layout.dropped):
      continue
    for pat, reps in layout.chunks:
      if re.search(pat, k):
        x = trees.to_numpy(v)
        if x.shape[0] % len(reps) == 0:
          for rep, part_ in zip(reps, np.split(x, len(reps), axis=0)):
            out[re.sub(pat, rep, k)] = part_
          break
    else:
      out[k] = v
  return out


def dropped(layout: Layout, keys) -> Dict[str, List[str]]:
  """The keys (after the aliases) that :func:`canonical` leaves out as
  ``layout.dropped`` says, by what they are."""
  out: Dict[str, List[str]] = {}
  for k in keys:
    for pat, rep in layout.aliases:
      k = re.sub(pat, rep, k)
    for pat, what in layout.dropped:
      if re.search(pat, k):
        out.setdefault(what, []).append(k)
        break
  return out


class _RowsByForm:
  """A layout's rows by the form of the keys they can match (digits as
  ``#``, :func:`_template`): a key is tried only against the rows of its
  form and those whose form is not known, in the table's order (the first
  row that matches a key maps it)."""

  def __init__(self, layout: Layout):
    self.by_form: Dict[str, List[int]] = {}
    self.loose: List[int] = []
    self.rows = [(_pattern(r.theirs), r) for r in layout.flat_rows()]
    for i, (_, row) in enumerate(self.rows):
      form = _template(row.theirs)
      (self.loose if form is None
       else self.by_form.setdefault(form, [])).append(i)
    self._cache: Dict[str, list] = {}

  def of(self, key: str) -> list:
    form = _DIGITS.sub("#", key)
    got = self._cache.get(form)
    if got is None:
      got = self._cache[form] = [self.rows[i] for i in sorted(
          (*self.by_form.get(form, ()), *self.loose))]
    return got


def _rows_by_form(layout: Layout) -> _RowsByForm:
  try:
    return _cached_rows_by_form(layout)
  except TypeError:  # a layout with an unhashable field
    return _RowsByForm(layout)


@functools.lru_cache(maxsize=64)
def _cached_rows_by_form(layout: Layout) -> _RowsByForm:
  return _RowsByForm(layout)


def to_ours(layout: Layout, state_dict: Mapping[str, np.ndarray],
            num_heads) -> Tuple[Dict[str, np.ndarray], List[str]]:
  """Their (canonical-key) state dict -> (our flat tree, keys no row maps).

  ``num_heads``: the heads multi-head ops split by, an int or ``{'model':
  .., 'map': ..}`` (see :class:`Row`). A tensor whose shape cannot be mapped
  (e.g. a fused q/k/v weight whose first axis is not divisible by 3) is left
  out; the checker then names it as mis-shaped, as it names a missing part
  of a tensor of ours."""
  rows = _rows_by_form(layout)
  flat: Dict[str, np.ndarray] = {}
  parts: Dict[str, Dict[int, np.ndarray]] = {}
  unmatched = []
  for key, value in state_dict.items():
    for rx, row in rows.of(key):
      m = rx.match(key)
      if m is not None:
        break
    else:
      unmatched.append(key)
      continue
    heads = (num_heads.get(row.heads, num_heads["model"])
             if isinstance(num_heads, Mapping) else num_heads)
    try:
      values = row.op.to_ours(np.asarray(value), heads)
    except ValueError:
      continue
    for path, v in zip(row.ours, values):
      path = _fill(path, m)
      if row.op.part is None:
        flat[path] = v
      else:
        parts.setdefault(path, {})[row.op.part[0]] = (v, row.op.part)
  for path, got in parts.items():
    count, axis = next(iter(got.values()))[1][1:]
    if len(got) == count:
      flat[path] = np.concatenate([got[i][0] for i in range(count)], axis)
  return flat, unmatched


_DIGITS = re.compile(r"\d+")


@functools.lru_cache(maxsize=None)
def _template(pattern: str) -> Optional[str]:
  """The form of the keys ``pattern`` can match: its placeholders and its
  digits as ``#`` (``encoderblock_{i}/MlpBlock_0`` ->
  ``encoderblock_#/MlpBlock_#``); None where a placeholder touches a digit
  or another placeholder (their digits would run together in a key)."""
  t = _PLACEHOLDER.sub("\0", pattern)
  if re.search("\0[\\d\0]|\\d\0", t):
    return None
  return _DIGITS.sub("#", t).replace("\0", "#")


class _Keys:
  """A flat tree's keys by their form (digits as ``#``): a row's pattern is
  tried only on the keys of its form, not on every key (a table's rows x a
  model's keys were millions of tries when every timm name's tables are
  made)."""

  def __init__(self, flat: Mapping[str, Any]):
    self.all = list(flat)
    self.by_form: Dict[str, List[str]] = {}
    for k in self.all:
      self.by_form.setdefault(_DIGITS.sub("#", k), []).append(k)

  def of(self, pattern: str) -> List[str]:
    form = _template(pattern)
    return self.all if form is None else self.by_form.get(form, [])


def _instances(row: Row, flat: Mapping[str, Any], keys: _Keys):
  """Every binding of the row's placeholders whose our paths all exist."""
  rx = _pattern(row.ours[0])
  found = []
  for key in keys.of(row.ours[0]):
    b = rx.match(key)
    if b is not None and all(_fill(p, b) in flat for p in row.ours):
      found.append(b)
  return found


def _emit(layout: Layout, flat: Mapping[str, Any], fn,
          used: Optional[set] = None) -> "collections.OrderedDict":
  out = collections.OrderedDict()
  used = set() if used is None else used
  keys = _Keys(flat)

  def emit(row, b):
    if row.when is not None and not row.when(flat):
      return
    paths = [_fill(p, b) for p in row.ours]
    out[_fill(row.theirs, b)] = fn(row.op, [flat[p] for p in paths])
    used.update(paths)

  for entry in layout.rows:
    if isinstance(entry, Repeat):
      per_row = [(r, _instances(r, flat, keys)) for r in entry.rows]
      indices = sorted({tuple(sorted(b.items())) for _, bs in per_row for b in bs},
                       key=lambda t: [int(v) for _, v in t])
      for idx in indices:
        b = dict(idx)
        for r, bs in per_row:
          if b in bs:
            emit(r, b)
    else:
      for b in _instances(entry, flat, keys):
        emit(entry, b)
  return out


def _float32(x):
  x = trees.to_numpy(x)  # a jax array's own memory where it can be (read-only)
  return x.astype(np.float32, copy=False) if x.dtype.kind in "fV" else x


def to_theirs(layout: Layout, flat: Mapping[str, Any]) -> "collections.OrderedDict":
  """Our flat tree -> their state dict (float32 numpy, contiguous), in table
  order. Raises naming what of ours the layout has no place for."""
  used = set()

  def convert(op, vals):
    ins = [_float32(x) for x in vals]
    out = op.to_theirs(ins)  # (a scalar stays one: differential attention's)
    out = np.ascontiguousarray(out).reshape(np.shape(out))
    # Their arrays are their own (contiguous, writable, no memory of ours),
    # copied only where the op did not make a new one.
    if not (out.flags.owndata and out.flags.writeable) or any(
        np.may_share_memory(out, x) for x in ins):
      out = np.array(out)
    return out

  out = _emit(layout, flat, convert, used)
  left = sorted(set(flat) - used)
  if left:
    raise ValueError(
        f"{layout.name}'s layout has no place for {len(left)} of these "
        f"variables: {left[:8]}{' ...' if len(left) > 8 else ''}. The model "
        f"has a feature that {layout.name} cannot hold.")
  return out


def expected(layout: Layout, shapes: Mapping[str, Tuple[int, ...]]
             ) -> "collections.OrderedDict":
  """Our flat shapes (a model's eval_shape tree) -> their keys and shapes."""
  return _emit(layout, shapes, lambda op, s: tuple(op.shape(list(s))))
