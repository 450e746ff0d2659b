"""Pretrained weights by name: the record of every tag vit_jax can load.

    from vit_jax.weights import pretrained
    rec = pretrained.lookup("vit_small_patch14_reg4_dinov2.lvd142m")
    rec.hub, rec.preprocessing(), rec.labels, rec.license

One record per ``architecture.tag`` (timm's names and tags): the Hugging
Face repo holding the weights, how images must be prepared for them (input
size, crop, interpolation, mean, std, as timm's ``pretrained_cfg``), what
the head gives (a label set's classes, an embedding, or nothing), and the
license. The records are generated from timm's own ``pretrained_cfg``s for
every architecture the weights layer maps and computes as timm does
(``python -m vit_jax.weights.pretrained --write``, which also writes the
architectures themselves into :mod:`vit_jax.models`; it lists a name only
when :func:`vit_jax.weights.verify.verify_timm` passes), and a test keeps
them equal to timm's; at run time neither timm nor the network is needed
to read them.
torchvision's released weights are records too (``vit_b_16.tv_in1k``).

:func:`vit_jax.create_model` and :func:`vit_jax.weights.load` use them;
:func:`list_names` is :func:`vit_jax.list_models`.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vit_jax.data import preprocessing as pp
from vit_jax.models import _timm_archs
from vit_jax.weights import _pretrained_cfgs, layouts
from vit_jax.weights.names import (  # noqa: F401  (the names' room)
    TORCHVISION, UnknownName, architectures, check_known)
from vit_jax.weights.verify import meta_device  # noqa: F401  (was here)


class Unsupported(UnknownName):
  """A timm name vit_jax does not build: a feature it lacks
  (:data:`vit_jax.weights.layouts.TIMM_UNSUPPORTED`), named."""


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """One set of released weights: where they are and what they expect."""

  name: str  # architecture.tag
  hub: Optional[str]  # Hugging Face repo id (None: torchvision's release)
  filename: Optional[str]  # the repo's weights file where not the default
  input_size: Tuple[int, int, int]
  crop_pct: float
  crop_mode: str
  interpolation: str
  mean: Tuple[float, float, float]
  std: Tuple[float, float, float]
  num_classes: int
  labels: Optional[str]  # the label set: 'imagenet-1k', 'imagenet-21k-goog'...
  license: Optional[str]
  torchvision: Optional[str] = None  # torchvision's weights name

  @property
  def architecture(self) -> str:
    return self.name.split(".", 1)[0]

  @property
  def tag(self) -> str:
    return self.name.split(".", 1)[1]

  @property
  def head(self) -> str:
    """'classes' (a label set), 'embedding' (a projection, e.g. CLIP's),
    or 'none'."""
    if not self.num_classes:
      return "none"
    return "classes" if self.labels else "embedding"

  @property
  def source(self) -> str:
    """What :func:`vit_jax.weights.load` reads them from."""
    if self.torchvision:
      return f"torchvision:{self.torchvision}"
    return f"hf-hub:{self.hub}"

  @property
  def max_seq_len(self) -> Optional[int]:
    """A NaFlex architecture's token budget per image: the patches of its
    ``input_size`` (576 for 384 px in patches of 16, timm's NaFlex
    evaluation length; 1024 for C-RADIO's 512 px); None for the others."""
    arch = _timm_archs.ARCHS.get(self.architecture) or {}
    if not arch.get("naflex"):
      return None
    from vit_jax import models  # pylint: disable=import-outside-toplevel
    patch = models.get_model(self.architecture).patch_size
    h, w = self.input_size[-2:]
    return (int(h) // patch) * (int(w) // patch)

  def preprocessing(self) -> pp.Preprocessing:
    """How images must be prepared for these weights (for a NaFlex
    architecture, with its :attr:`max_seq_len`)."""
    return pp.from_timm_cfg(dict(
        input_size=self.input_size, crop_pct=self.crop_pct,
        crop_mode=self.crop_mode, interpolation=self.interpolation,
        mean=self.mean, std=self.std, max_seq_len=self.max_seq_len))

  def as_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


def _records() -> Dict[str, Pretrained]:
  out = {name: Pretrained(name=name, **cfg)
         for name, cfg in _pretrained_cfgs.PRETRAINED.items()}
  for name, weights in TORCHVISION.items():
    out[name] = Pretrained(
        name=name, hub=None, filename=None, input_size=(3, 224, 224),
        crop_pct=0.875, crop_mode="center", interpolation="bilinear",
        mean=pp.IMAGENET_MEAN, std=pp.IMAGENET_STD, num_classes=1000,
        labels="imagenet-1k", license="bsd-3-clause", torchvision=weights)
  return out


_RECORDS = _records()
# The default tag of an architecture: timm's first (its best weights).
_DEFAULT = {}
for _name in _RECORDS:
  _DEFAULT.setdefault(_name.split(".", 1)[0], _name)


def is_name(name: str) -> bool:
  """Whether ``name`` is a known architecture or ``architecture.tag``
  (not one vit_jax refuses: :func:`lookup` says why)."""
  base = str(name).split(".", 1)[0]
  if layouts.unsupported_timm(base):
    return False
  return name in _RECORDS or (("." not in name) and (
      base in _timm_archs.ARCHS or base in _DEFAULT))


def lookup(name: str) -> Pretrained:
  """The record of ``architecture.tag``, or of an architecture's default
  tag; an :class:`UnknownName` error suggests the closest names (an
  :class:`Unsupported` one names the feature vit_jax lacks)."""
  name = str(name)
  layouts.refuse_unsupported_timm(name, Unsupported)
  if name in _RECORDS:
    return _RECORDS[name]
  if "." not in name and name in _DEFAULT:
    return _RECORDS[_DEFAULT[name]]
  base = name.split(".", 1)[0]
  if base in _DEFAULT or base in _timm_archs.ARCHS:
    tags = [n for n in _RECORDS if n.startswith(base + ".")]
    raise UnknownName(
        f"{name!r}: {base} has no pretrained weights tagged "
        f"{name.split('.', 1)[1] if '.' in name else ''!r} that vit_jax "
        f"knows; its tags: {', '.join(tags) or 'none'}.")
  close = difflib.get_close_matches(name, list(_RECORDS) + architectures(),
                                    n=5, cutoff=0.6)
  raise UnknownName(
      f"{name!r} is not a name vit_jax knows (list them with "
      f"vit_jax.list_models('*pattern*', pretrained=True))."
      + (f" Close: {', '.join(close)}." if close else "")
      + " A Hugging Face repo loads as 'hf-hub:org/name'.")


def list_names(pattern: str = "*", pretrained: bool = False,
               exclude: Sequence[str] = ()) -> List[str]:
  """Names matching ``pattern`` (fnmatch, like timm's ``list_models``):
  architectures, or with ``pretrained=True`` every ``architecture.tag``
  with released weights."""
  pool = list(_RECORDS) if pretrained else architectures()
  names = [n for n in pool if fnmatch.fnmatchcase(n, pattern) or (
      pretrained and fnmatch.fnmatchcase(n.split(".", 1)[0], pattern))]
  return sorted(n for n in names
                if not any(fnmatch.fnmatchcase(n, e) for e in exclude))


# --------------------------------------------------------------------------- #
# The generator (needs timm): python -m vit_jax.weights.pretrained --write
# --------------------------------------------------------------------------- #

FAMILY_PATTERNS = ("vit_*", "deit*", "eva02_*", "eva_*", "aimv2_*",
                   "naflexvit_*", "beit*", "samvit_*", "cait_*", "flexivit_*",
                   "test_vit", "test_vit2", "test_vit3", "vitamin_*")


def _timm_architectures(patterns: Sequence[str] = FAMILY_PATTERNS,
                        verify: bool = True):
  """{timm name: our architecture record} for every timm architecture of
  ``patterns`` that the weights layer maps (built on the meta device: the
  shapes of its state dict, no memory) and, with ``verify``, whose numbers
  are timm's (:func:`vit_jax.weights.verify.verify_timm`: a name that maps
  but computes something else is left out, and said on stderr: it belongs
  in :data:`vit_jax.weights.layouts.TIMM_UNSUPPORTED`, naming what
  vit_jax lacks)."""
  import warnings  # pylint: disable=import-outside-toplevel

  import numpy as np  # pylint: disable=import-outside-toplevel
  import timm  # pylint: disable=import-outside-toplevel

  from vit_jax import models  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import build  # pylint: disable=import-outside-toplevel

  defaults = {f.name: f.default for f in dataclasses.fields(
      models.VisionTransformer)}
  out = {}
  names = sorted({n for p in patterns for n in timm.list_models(p)})
  for name in names:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      try:
        with meta_device():
          m = timm.create_model(name, pretrained=False)
      except Exception:  # pylint: disable=broad-except
        continue
    sd = {k: np.broadcast_to(np.float32(0), tuple(v.shape))
          for k, v in m.state_dict().items()}
    try:
      with build.names_from_timm():  # not in the tables yet, maybe
        model, _ = build.from_state_dict(sd, name, layout="timm")
    except ValueError:
      continue  # a feature vit_jax does not map: not listed
    arch = models.arch_record(model)
    arch["num_classes"] = int(model.num_classes or 0)
    size = getattr(getattr(m, "patch_embed", None), "img_size", None)
    if size is not None:
      arch["image_size"] = tuple(int(s) for s in size)
    for option in ("dynamic_img_size", "dynamic_img_pad"):  # timm's default
      if getattr(m, option, False) or getattr(getattr(
          m, "patch_embed", None), option, False):
        arch[option] = True
    if type(m).__name__ == "VisionTransformerSAM":  # resamples in forward
      arch["dynamic_img_size"] = True
    same = lambda a, b: (list(a) == list(b) if isinstance(  # noqa: E731
        a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b)
    out[name] = {k: v for k, v in arch.items()
                 if not same(v, defaults.get(k, ()))}
  return _verified(out) if verify else out


def _verified(archs):
  """``archs`` less the names whose numbers are not timm's (names not in
  the tables yet load under timm's registry's word: the check is of their
  numbers)."""
  from vit_jax.weights import build, verify  # pylint: disable=import-outside-toplevel

  with build.names_from_timm():
    results = verify.verify_many(verify.plan(archs))
  failed = {n: r for n, r in results.items()
            if isinstance(r, verify.NotVerified)}
  for why in failed.values():
    print(f"not listed: {why}\n  (add the name's pattern to vit_jax.weights."
          f"layouts.TIMM_UNSUPPORTED, naming the feature vit_jax lacks)",
          file=sys.stderr)
  return {k: v for k, v in archs.items() if k not in failed}


def _timm_pretrained(archs) -> Dict[str, Dict[str, Any]]:
  import timm  # pylint: disable=import-outside-toplevel
  from timm.data import infer_imagenet_subset  # pylint: disable=import-outside-toplevel
  from timm.models import get_pretrained_cfg  # pylint: disable=import-outside-toplevel

  out = {}
  for arch in sorted(archs):
    for name in timm.list_pretrained(f"{arch}.*"):
      cfg = get_pretrained_cfg(name)
      if not cfg.hf_hub_id:
        continue  # not on the Hugging Face Hub
      d = cfg.to_dict()
      out[name] = dict(
          hub=d["hf_hub_id"], filename=d.get("hf_hub_filename") or None,
          input_size=tuple(int(x) for x in d.get("input_size", (3, 224, 224))),
          crop_pct=float(d.get("crop_pct", 0.875)),
          crop_mode=str(d.get("crop_mode") or "center"),
          interpolation=str(d.get("interpolation") or "bicubic"),
          mean=tuple(float(x) for x in d.get("mean", pp.IMAGENET_MEAN)),
          std=tuple(float(x) for x in d.get("std", pp.IMAGENET_STD)),
          num_classes=int(d.get("num_classes") or 0),
          labels=infer_imagenet_subset(cfg) if d.get("num_classes") else None,
          license=d.get("license"))
  return out


def _source(header: str, name: str, table: Dict[str, Any]) -> str:
  lines = [f'"""{header}\n\nGenerated by ``python -m vit_jax.weights.pretrained '
           f'--write`` from timm; do not edit.\n"""\n',
           "# flake8: noqa", "# pylint: skip-file", "", f"{name} = {{"]
  for key in sorted(table):
    lines.append(f"    {key!r}: {table[key]!r},")
  lines.append("}")
  return "\n".join(lines) + "\n"


def generate(patterns: Sequence[str] = FAMILY_PATTERNS, verify: bool = True):
  """(architectures, pretrained records) as timm has them now: of the
  names the weights layer maps and does not refuse, those whose numbers
  are timm's (``verify=False``: all of them, without building any)."""
  archs = _timm_architectures(patterns, verify)
  return archs, _timm_pretrained(archs)


def write_tables(verify: bool = True) -> Tuple[str, str]:
  """(Re)writes :mod:`vit_jax.models._timm_archs` and
  :mod:`vit_jax.weights._pretrained_cfgs` (see :func:`generate`)."""
  import os  # pylint: disable=import-outside-toplevel

  archs, records = generate(verify=verify)
  here = os.path.dirname(os.path.abspath(__file__))
  paths = (os.path.join(here, "..", "models", "_timm_archs.py"),
           os.path.join(here, "_pretrained_cfgs.py"))
  texts = (_source("The architecture of every timm name vit_jax builds: "
                   "the fields of\n:class:`vit_jax.models.VisionTransformer` "
                   "(plus its classes and image size).", "ARCHS", archs),
           _source("timm's pretrained_cfg of every tag vit_jax loads (see "
                   ":mod:`vit_jax.weights.pretrained`).", "PRETRAINED",
                   records))
  for path, text in zip(paths, texts):
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
  return tuple(os.path.normpath(p) for p in paths)


if __name__ == "__main__":
  if sys.argv[1:] != ["--write"]:
    sys.exit("usage: python -m vit_jax.weights.pretrained --write")
  for p in write_tables():
    print(f"wrote {p}")
