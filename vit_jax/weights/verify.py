"""The check that lists a timm name: timm's model on random weights against
ours loaded from its state dict, both ways.

    from vit_jax.weights import verify
    result = verify.verify_timm("vit_small_patch14_reg4_dinov2")   # or raises
    result.rel, result.rel_back, result.image_size

:func:`verify_timm` builds timm's architecture ``name`` (``depth`` blocks
where timm's constructor takes ``depth``; at timm's input size, or a small
grid of patches where the architecture allows one), fills every float of
its state dict with random values at scales where each matters (LayerScale
gammas, heads and biases far from their zero / 1e-5 initialisations;
activations into the first norm small enough that its epsilon shows),
loads the state dict through :func:`vit_jax.formats.from_timm` and compares
``model.apply`` with timm's ``forward`` in float32 at the highest matmul
precision: ``max|ours - timm| <= rel * max|timm|``. Then
:func:`vit_jax.formats.to_timm` must load into timm's model with
``strict=True`` and give timm's logits (bit-identical tensors need no
second forward). A failure raises :class:`NotVerified` naming the stage.

The generator of the pretrained tables
(:mod:`vit_jax.weights.pretrained`) lists only names this check passes,
and ``tests/weights/test_registry.py`` runs it for every listed name.

timm models are built on the meta device (no memory, no initialisation)
and given their random state dict with ``assign=True``; the buffers timm
computes and does not save (RoPE frequencies, Eva's zero key bias) are
computed by timm's own ``init_non_persistent_buffers``. The random values
are slices of one pool of normal samples (:class:`RandomWeights`), the same
tensor for the same key and shape, so names that share blocks share them.

torch and timm are imported inside the functions: importing this module
imports neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import zlib
from typing import (Any, Callable, Dict, List, Mapping, NamedTuple,
                    Optional, Sequence, Tuple)

import numpy as np

REL = 1e-5
# A small grid of patches for the architectures that run at any size
# (the position embedding built for it): square, so that a name's square
# resolution stays a square grid.
SMALL_GRID = 4
# The input of a name built at timm's size whose model resizes its
# positions in forward (timm's ``dynamic_img_size``: SAM, DINOv3,
# LingBot) where a smaller one of the same kind runs at that size
# (:func:`plan`): a square of patches, past SAM's 14-patch window (so
# windows are padded) and below every such name's own grid.
RESIZED_GRID = 16
# The images' scale (the weights': RandomWeights.scale): small enough that
# the first norm's epsilon shows (1e-5 for 1e-6 moves the logits ~1e-4).
IMAGE_STD = 0.1


class NotVerified(AssertionError):
  """A timm name whose numbers are not timm's (or that does not load)."""

  def __init__(self, name: str, stage: str, detail: str):
    super().__init__(f"{name}: {stage}: {detail}")
    self.name, self.stage, self.detail = name, stage, detail


@dataclasses.dataclass(frozen=True)
class Verified:
  name: str
  depth: Optional[int]  # the blocks built (None: timm's own depth)
  image_size: Optional[Tuple[int, int]]  # None: NaFlex patch dicts
  native: bool  # at timm's own input size
  rel: float  # max|ours - timm| / max|timm|
  rel_back: float  # the same for timm loaded with to_timm (0: bit-identical)
  seconds: float  # CPU seconds of the process (all threads)
  phases: Dict[str, float]  # CPU seconds per phase
  # Where rel > REL: (ours, timm's float32) each against timm in float64,
  # ours within twice timm's own rounding (:func:`_exact_errors`).
  exact: Optional[Tuple[float, float]] = None

  @property
  def ok(self) -> bool:
    within = self.rel <= REL or (self.exact is not None and
                                 self.exact[1] > REL and
                                 self.exact[0] <= 2 * self.exact[1])
    return within and self.rel_back <= REL


class RandomWeights:
  """Random state dicts for timm's models, cheap enough for every name.

  One pool of ``size`` standard-normal float32 samples (seeded); a tensor
  is a scaled copy of a slice of it at an offset decided by its key and
  shape (distinct within a model), so the same key and shape give the same
  values in every model, and the previous model's tensors are reused."""

  def __init__(self, seed: int = 0, size: int = 1 << 26):
    self.seed, self.size = seed, size
    self._pool = None
    self._last: Dict[Any, Any] = {}

  def pool(self):
    import torch  # pylint: disable=import-outside-toplevel
    if self._pool is None:
      rng = np.random.default_rng(self.seed)
      self._pool = torch.from_numpy(rng.standard_normal(self.size,
                                                        dtype=np.float32))
    return self._pool

  @staticmethod
  def scale(key: str, shape) -> Tuple[float, float]:
    """(mean, std) of the tensor ``key``: weights of Linear / conv layers
    N(0, 1/fan_in); norm scales 1 + N(0, 0.2); everything else (biases,
    LayerScale gammas, tokens, position embeddings) N(0, 0.1)."""
    if key.endswith("weight") and len(shape) >= 2:
      return 0.0, float(np.prod(shape[1:])) ** -0.5
    if key.endswith("weight") and len(shape) == 1:
      return 1.0, 0.2
    return 0.0, 0.1

  def state_dict(self, template) -> Dict[str, Any]:
    """A random state dict with ``template``'s keys, shapes and dtypes
    (every float entry random; others kept)."""
    import torch  # pylint: disable=import-outside-toplevel
    pool, out, taken, cache = self.pool(), {}, set(), {}
    for key, t in template.items():
      if not t.is_floating_point():
        if t.is_meta:
          raise ValueError(f"{key}: a non-float tensor the meta device "
                           f"cannot give ({t.dtype})")
        out[key] = t
        continue
      n, shape = t.numel(), tuple(t.shape)
      if n > self.size:
        raise ValueError(f"{key}: {n} values, more than the pool's "
                         f"{self.size}; make the pool larger")
      span = self.size - n + 1
      offset = zlib.crc32(f"{key}{shape}".encode()) % span
      while offset in taken:  # no two tensors of a model start alike
        offset = (offset + 1) % span
      taken.add(offset)
      mean, std = self.scale(key, shape)
      ident = (offset, shape, mean, std)
      value = self._last.get(ident)
      if value is None:
        value = pool[offset:offset + n].view(shape) * std
        if mean:
          value += mean
      cache[ident] = value
      out[key] = value.to(t.dtype) if t.dtype != torch.float32 else value
    self._last = cache
    return out


# In-place ops that only write values (what timm's and torch's
# initialisers call): on a meta tensor, which holds none, they are no-ops.
_META_VALUE_OPS = frozenset((
    "uniform_", "normal_", "zero_", "fill_", "clamp_", "erfinv_", "mul_",
    "add_", "sub_", "div_", "copy_", "exponential_", "log_normal_",
    "random_", "bernoulli_", "fill_diagonal_",
    # torch.nn.init's that dispatch on their own (keyword ``tensor``).
    "kaiming_uniform_", "constant_"))


@contextlib.contextmanager
def meta_device():
  """torch's meta device for building timm models without memory, ~3x
  faster than a bare ``torch.device("meta")``: timm's truncated-normal
  init clamps every weight, and torch runs ``clamp_`` on a meta tensor
  through its Python reference implementation (about 5 ms a call, three
  quarters of the time to build every timm architecture). A meta tensor
  holds no values, so the in-place ops that only write values
  (``clamp_``, ``uniform_``, ``normal_``, ``mul_`` ...: the initialisers')
  return it here at once, without torch's dispatch (a further quarter less
  time: 76 timm names 12.0 -> 8.7-9.0 s on an AMD Zen 1); every other op runs
  as on the plain meta device (the same parameters, shapes and dtypes)."""
  import torch  # pylint: disable=import-outside-toplevel
  try:  # the meta device's own mode, so that each call passes one mode
    from torch.utils._device import DeviceContext  # pylint: disable=import-outside-toplevel
  except ImportError:
    DeviceContext = None

  def no_values(func, args, kwargs):
    if getattr(func, "__name__", None) in _META_VALUE_OPS:
      t = args[0] if args else (kwargs or {}).get("tensor")
      if getattr(t, "is_meta", False):
        return t
    return None

  if DeviceContext is not None:

    class _Meta(DeviceContext):

      def __torch_function__(self, func, types, args=(), kwargs=None):
        t = no_values(func, args, kwargs)
        if t is not None:
          return t
        return super().__torch_function__(func, types, args, kwargs)

    with _Meta("meta"):
      yield
    return

  from torch.overrides import TorchFunctionMode  # pylint: disable=import-outside-toplevel

  class _NoMetaValues(TorchFunctionMode):

    def __torch_function__(self, func, types, args=(), kwargs=None):
      t = no_values(func, args, kwargs)
      return t if t is not None else func(*args, **(kwargs or {}))

  with torch.device("meta"), _NoMetaValues():
    yield


def _meta_model(name: str, **kwargs):
  import timm  # pylint: disable=import-outside-toplevel
  with meta_device():
    return timm.create_model(name, pretrained=False, **kwargs)


def _try_meta(name: str, arg: str, **kwargs):
  """timm's meta model with ``kwargs``, or None where its constructor does
  not take ``arg``."""
  try:
    return _meta_model(name, **kwargs)
  except TypeError as e:
    if f"'{arg}'" not in str(e):
      raise
    return None


def timm_meta(name: str, depth: Optional[int] = 2, small: bool = False):
  """``(model on the meta device, create_model kwargs)``: ``depth`` blocks
  where timm's constructor takes ``depth`` (and what goes with it:
  :func:`depth_kwargs`); with ``small`` a square of
  ``SMALL_GRID`` patches where it takes ``img_size`` (not for NaFlex,
  whose input is patches)."""
  kwargs: Dict[str, Any] = {}
  m = None
  if depth is not None:
    extra = depth_kwargs(name, depth)
    m = _try_meta(name, "depth", depth=depth, **extra)
    if m is not None:
      kwargs.update(depth=depth, **extra)
  if m is None:
    m = _meta_model(name)
  if small and not is_naflex(name):
    # Pixels per token (a hybrid's CNN stride times its patch embedding's).
    pe = m.patch_embed
    p = tuple(int(i) // int(g) for i, g in zip(pe.img_size, pe.grid_size))
    size = (SMALL_GRID * p[0], SMALL_GRID * p[1])
    reduced = _try_meta(name, "img_size", img_size=size, **kwargs)
    if reduced is not None:
      m, kwargs["img_size"] = reduced, size
  return m, kwargs


def depth_kwargs(name: str, depth: int) -> Dict[str, Any]:
  """What else timm's constructor takes for a model of ``depth`` blocks:
  SAM's global blocks (timm's ``global_attn_indexes``, e.g. 2, 5, 8, 11
  for B) are past the second block, so at depth 2 the last block is made
  global, the first stays windowed (the loader reads which is which from
  the rel-pos tables). Sapiens2's key/value heads are one per block
  (``num_kv_heads``, its full depth's): up to 16 blocks timm's own rule
  gives every block all its heads (grouped-query attention only between
  the first and the last 8), which timm's attention reads from 0 (``0 or
  num_heads``; create_model drops a None)."""
  base = name.split(".", 1)[0]
  if base.startswith("samvit_"):
    return {"global_attn_indexes": (depth - 1,)}
  if base.endswith("_sapiens2") and depth <= 16:
    return {"num_kv_heads": 0}
  return {}


def is_naflex(name: str) -> bool:
  return name.split(".", 1)[0].startswith("naflexvit_")


def materialize(m, weights: Optional[RandomWeights] = None):
  """timm's model ``m`` built on the meta device, given a random state
  dict (assigned, not copied) and the buffers it computes (computed by
  timm's ``init_non_persistent_buffers``). Returns the state dict."""
  import torch  # pylint: disable=import-outside-toplevel
  from timm.models import _manipulate  # pylint: disable=import-outside-toplevel

  weights = weights or RandomWeights()
  for module in m.modules():  # computed, not saved: materialize, compute
    for key in module._non_persistent_buffers_set:  # pylint: disable=protected-access
      b = module._buffers.get(key)  # pylint: disable=protected-access
      if b is not None and b.is_meta:
        module._buffers[key] = torch.empty_like(b, device="cpu")  # pylint: disable=protected-access
  sd = weights.state_dict(m.state_dict())
  m.load_state_dict(sd, strict=True, assign=True)
  _manipulate.reinit_non_persistent_buffers(m)
  meta = [k for k, v in list(m.named_parameters()) + list(m.named_buffers())
          if v.is_meta]
  if meta:
    raise ValueError(f"tensors left on the meta device: {meta[:5]}")
  m.eval()
  return sd


def random_timm(name: str, weights: Optional[RandomWeights] = None,
                depth: Optional[int] = 2, small: bool = False):
  """timm's model ``name`` with random weights: ``(model, state_dict,
  create_model kwargs)`` (see :func:`timm_meta`)."""
  m, kwargs = timm_meta(name, depth, small)
  return m, materialize(m, weights), kwargs


def _rel(ours, ref, name: str) -> float:
  """max|ours - ref| / max|ref| (inf for another shape)."""
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  if ours.shape != ref.shape:
    return float("inf")
  scale = float(np.abs(ref).max())
  if not scale > 0:
    raise NotVerified(name, "logits", "timm's output is all zeros: the "
                      "check would prove nothing")
  return float(np.abs(ours - ref).max()) / scale


def inputs(name: str, model, image_size, batch: int, seed: int = 0):
  """(ours, timm's) inputs: NHWC images and NCHW tensors, or for a NaFlex
  model the patch dicts of two images of different aspect ratios (3x5
  and 4x2 patches, padded to 16)."""
  import torch  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  if image_size is not None:
    x = (IMAGE_STD * rng.standard_normal(
        (batch, *image_size, 3))).astype(np.float32)
    return x, torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
  from timm.data.naflex_transforms import patchify_image  # pylint: disable=import-outside-toplevel
  p, seq = tuple(model.embeds.patch_size), 16
  out = {"patches": [], "patch_coord": [], "patch_valid": []}
  for h, w in ((3, 5), (4, 2)):
    img = torch.from_numpy((IMAGE_STD * rng.standard_normal(
        (3, h * p[0], w * p[1]))).astype(np.float32))
    patches, coord, valid = patchify_image(img, p)
    pad = seq - patches.shape[0]
    out["patches"].append(torch.cat([patches,
                                     patches.new_zeros(pad, patches.shape[1])]))
    out["patch_coord"].append(torch.cat([coord, coord.new_zeros(pad, 2)]))
    out["patch_valid"].append(torch.cat([valid, valid.new_zeros(pad)]))
  t = {k: torch.stack(v) for k, v in out.items()}
  return {k: v.numpy() for k, v in t.items()}, t


# XLA:CPU options for the check's programs, each run once: no LLVM
# optimisation, no fusion emitters, one codegen split compile a depth-2
# model ~3x faster (~0.12 s instead of ~0.37 s on a Xeon core; the numbers
# stay float32 at the highest matmul precision: the mapping is what is
# checked, and the errors are those of the default options, ~1e-6).
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                    "xla_cpu_use_fusion_emitters": False,
                    "xla_cpu_parallel_codegen_split_count": 1}
_COMPILED: Dict[Any, Any] = {}


def _forward(model, variables, x):
  """``model.apply(variables, x, train=False)``, compiled once per model
  and input shapes (names that build the same model share it). Compiled:
  for these one-off calls eager dispatch is slower (each op compiled on
  its own, ~5 s a model) and ``jax.disable_jit`` slower still."""
  import jax  # pylint: disable=import-outside-toplevel
  shapes = jax.tree_util.tree_map(lambda a: (np.shape(a), str(a.dtype)),
                                  (variables, x))
  key = (model, repr(shapes))
  fn = _COMPILED.get(key)
  if fn is None:
    apply = lambda v, x: model.apply(v, x, train=False)  # noqa: E731
    fn = jax.jit(apply).lower(variables, x).compile(
        compiler_options=COMPILER_OPTIONS)
    if len(_COMPILED) >= 4:
      _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = fn
  return fn(variables, x)


class Check(NamedTuple):
  """One name of a :func:`plan`: at timm's input size or ``small``; the
  names of one ``group`` share a record but for the image size. ``grid``:
  built at timm's size, fed a square of ``grid`` patches (None: its own
  size)."""
  name: str
  small: bool
  group: int
  grid: Optional[int] = None


def plan(archs: Mapping[str, Mapping[str, Any]]) -> List[Check]:
  """The checks of the architecture records ``archs``
  (``models._timm_archs.ARCHS``' form), grouped by record: of the names
  whose records differ only in ``image_size``, the one of the smallest
  size runs at timm's input size, as does every name whose size is not a
  multiple of its patch (the loader keeps the remainder out, as timm's
  convolution) and every NaFlex name (its input is patches); the others
  run on a ``SMALL_GRID`` square of patches (the same model as their
  group's other small ones: one compile).

  Models that resize their positions in forward (``dynamic_img_size``
  records: SAM, DINOv3, LingBot) and differ from another such record only
  in their widths and depths (``_SIZE_FIELDS``) are one kind: the
  narrowest of a kind runs at timm's size; the others, built at timm's
  size (every weight its real shape), on a ``RESIZED_GRID`` square of
  patches where their own grid is larger (timm's resampling of the
  position embedding and rel-pos tables, checked on the way: SAM-L and
  SAM-H at 256 px rather than 1024, 40 s each on a 2-core Zen 3)."""
  groups: Dict[str, List[str]] = {}
  for name in sorted(archs):
    key = repr(sorted((k, repr(v)) for k, v in archs[name].items()
                      if k != "image_size"))
    groups.setdefault(key, []).append(name)
  out = []
  for group, names in enumerate(groups.values()):
    size = lambda n: tuple(archs[n].get("image_size") or (0, 0))  # noqa: E731
    first = min(names, key=size)
    for name in sorted(names, key=lambda n: (n != first, size(n), n)):
      rec = archs[name]
      patch = int(rec.get("patch_size", 16))
      odd = any(int(s) % patch for s in rec.get("image_size") or ())
      small = not (name == first or odd or is_naflex(name))
      out.append(Check(name, small, group))
  return _resized(archs, out)


# The fields a kind of dynamic-size model varies (see :func:`plan`).
_SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "mlp_dim",
                "global_attn_indexes", "image_size")


def _resized(archs, checks: List[Check]) -> List[Check]:
  """``checks`` with ``grid`` set where :func:`plan` says."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  defaults = {f.name: f.default
              for f in dataclasses.fields(models.VisionTransformer)}
  field = lambda n, k: archs[n].get(k, defaults.get(k))  # noqa: E731
  kinds: Dict[str, List[str]] = {}
  for c in checks:
    rec = archs[c.name]
    if rec.get("dynamic_img_size") and not c.small and not is_naflex(c.name):
      key = repr(sorted((k, repr(v)) for k, v in rec.items()
                        if k not in _SIZE_FIELDS))
      kinds.setdefault(key, []).append(c.name)
  grid = {}
  for names in kinds.values():
    first = min(names, key=lambda n: (field(n, "hidden_size"),
                                      field(n, "num_layers"), n))
    for n in names:
      size = archs[n].get("image_size") or ()
      patch = int(field(n, "patch_size"))
      if n != first and size and min(int(s) // patch
                                     for s in size) > RESIZED_GRID:
        grid[n] = RESIZED_GRID
  return [c._replace(grid=grid.get(c.name)) for c in checks]


def verify_many(checks: Sequence[Check],
                weights: Optional[RandomWeights] = None) -> Dict[str, Any]:
  """``{name: Verified or NotVerified}`` for ``checks``, in their order
  (a group's names share weights and compiled programs). Nothing is
  raised for a name that fails: its :class:`NotVerified` is its result.

  In one process: two worker processes on this project's busy 2-core
  machine took 1.3x the time of one (their start-up, each its own pool of
  weights, and no free core to gain)."""
  weights = weights or RandomWeights()
  out: Dict[str, Any] = {}
  for c in checks:
    try:
      out[c.name] = verify_timm(c.name, small=c.small, grid=c.grid,
                                weights=weights)
    except NotVerified as e:
      out[c.name] = e
    except Exception as e:  # pylint: disable=broad-except
      out[c.name] = NotVerified(c.name, "check", f"{type(e).__name__}: {e}")
  return out


def verify_timm(name: str, *, depth: Optional[int] = 2, small: bool = False,
                rel: float = REL, batch: Optional[int] = None,
                weights: Optional[RandomWeights] = None,
                load: Optional[Callable[..., Any]] = None,
                grid: Optional[int] = None) -> Verified:
  """Checks timm's architecture ``name`` against ours, both ways; raises
  :class:`NotVerified` (naming the stage and the error) or returns the
  errors. ``small``: a small grid of patches where the architecture takes
  one (else timm's own input size); ``depth``: the blocks (None: timm's);
  ``batch``: images (default: 2 on the small grid, 1 at timm's size; a
  NaFlex batch is two images); ``load(state_dict, name) -> (model,
  variables)``: the loader checked (default :func:`formats.from_timm`);
  ``grid``: the model built at timm's size takes a square of ``grid``
  patches (one whose positions are resized in forward: timm's
  ``dynamic_img_size``)."""
  import torch  # pylint: disable=import-outside-toplevel

  # torch on one thread: for these short calls its idle OpenMP threads
  # only spin (10x the CPU time, and on a busy 2-core machine 10x the
  # wall time); XLA's own threads are left as they are.
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    return _verify(name, depth, small, rel, batch, weights, load, grid)
  finally:
    torch.set_num_threads(threads)


def _verify(name, depth, small, rel, batch, weights, load,
            grid=None) -> Verified:
  import jax  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import layouts, saving  # pylint: disable=import-outside-toplevel

  clock = _Clock()
  try:
    m, sd, kwargs = random_timm(name, weights, depth, small)
  except Exception as e:  # pylint: disable=broad-except
    raise NotVerified(name, "timm build", f"{type(e).__name__}: {e}") from e
  size = None if is_naflex(name) else tuple(
      int(s) for s in m.patch_embed.img_size)
  if grid is not None and size is not None:
    if small:
      raise ValueError("verify_timm: grid= is for a model built at timm's "
                       "size, not a small one")
    pe = m.patch_embed
    size = tuple(grid * (int(i) // int(g))
                 for i, g in zip(pe.img_size, pe.grid_size))
  batch = batch or (2 if "img_size" in kwargs else 1)
  x, xt = inputs(name, m, size, batch)
  clock("build")
  with torch.no_grad():
    ref = m(xt).numpy()
  clock("timm")
  try:
    if load is None and grid is not None:  # resized in forward, as timm
      load = functools.partial(_from_timm, dynamic_img_size=True)
    model, variables = (load or _from_timm)(sd, name)
  except Exception as e:  # pylint: disable=broad-except
    raise NotVerified(name, "from_timm", f"{type(e).__name__}: {e}") from e
  clock("from_timm")
  with jax.default_matmul_precision("highest"):
    got = np.asarray(_forward(model, variables, x))
  clock("ours")
  err = _rel(got, ref, name)
  exact = None if err <= rel else _exact_errors(m, xt, got, ref, name)
  if not err <= rel and not (exact[1] > REL and exact[0] <= 2 * exact[1]):
    raise NotVerified(name, "logits", (
        f"ours differ from timm's: max|ours - timm| / max|timm| = {err:.3g} "
        f"> {rel:g} (shapes {got.shape}, {ref.shape}; timm {kwargs}, "
        f"input {size or 'NaFlex patches'})"))
  try:
    back = saving.to_torch(saving.to_state_dict(
        variables, layouts.timm_layout_for_name(name) or "timm"))
    m.load_state_dict(back, strict=True, assign=True)
  except Exception as e:  # pylint: disable=broad-except
    raise NotVerified(name, "to_timm (strict load)",
                      f"{type(e).__name__}: {e}") from e
  err_back = 0.0
  if any(not torch.equal(back[k], v) for k, v in sd.items()):
    with torch.no_grad():
      err_back = _rel(m(xt).numpy(), ref, name)
    if not err_back <= rel:
      raise NotVerified(name, "to_timm (logits)", (
          f"timm with our weights differs: rel {err_back:.3g} > {rel:g}"))
  clock("back")
  return Verified(name=name, depth=kwargs.get("depth"), image_size=size,
                  native="img_size" not in kwargs and grid is None,
                  rel=err, rel_back=err_back,
                  seconds=clock.total, phases=clock.phases, exact=exact)


def _exact_errors(m, xt, got, ref, name) -> Tuple[float, float]:
  """(ours, timm's float32) logits' errors against timm's in float64.
  Where timm's own float32 logits are more than ``REL`` from the exact
  ones (timm's model in float64: a deep ResNet stem on random weights
  reaches 4e-5), ours pass if they are within twice timm's float32 error
  of the exact logits (two independent float32 roundings
  of one function; the other library's ResNet constants, the nearest
  wrong function, are off by 5.6e-4 to 3.6e-2: tests/weights/
  test_hybrid.py)."""
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    exact = m.double()(xt.double()).numpy()
  m.float()
  return _rel(got, exact, name), _rel(ref, exact, name)


def _from_timm(state_dict, name, **options):
  """:func:`vit_jax.formats.from_timm` (this room's own function)."""
  from vit_jax.weights import build  # pylint: disable=import-outside-toplevel
  return build.from_state_dict(state_dict, name, layout="timm", **options)


class _Clock:
  """CPU seconds of this process (all threads) per phase."""

  def __init__(self):
    self.phases: Dict[str, float] = {}
    self._last = self._start = time.process_time()

  def __call__(self, phase: str):
    now = time.process_time()
    self.phases[phase] = now - self._last
    self._last = now

  @property
  def total(self) -> float:
    return self._last - self._start
