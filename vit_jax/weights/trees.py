"""Our parameter tree as data: numpy conversion, flat '/'-joined paths, the
scanned <-> per-layer layouts, and the architecture read back from a tree.

Flat paths name the collection first (``params/Transformer/encoderblock_0/
LayerNorm_0/scale``, ``batch_stats/stem_bns_0/mean``): one string says where a
tensor lives in ``model.init``'s variables.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Mapping, Optional

import numpy as np

from vit_jax import models
from vit_jax.models import relpos

_BLOCK = re.compile(r"^encoderblock_(\d+)$")
_CLASS_BLOCK = re.compile(r"^classblock_\d+$")  # CaiT's class attention


def to_numpy(x, copy: bool = True) -> np.ndarray:
  """torch tensor / jax array / numpy -> numpy. torch's float16/bfloat16
  become float32 (numpy cannot hold torch's bfloat16); a bfloat16 saved by
  numpy (2-byte void) is read as ml_dtypes' bfloat16 and kept. A torch
  tensor is copied, or with ``copy=False`` read through a read-only view of
  its memory (then :func:`owned` before anything is handed out)."""
  if hasattr(x, "detach"):  # torch.Tensor, without importing torch
    x = x.detach().cpu()
    if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
      x = x.float()
    if copy:
      return x.numpy().copy()  # .numpy() would share the tensor's memory
    view = x.numpy()
    view.flags.writeable = False  # theirs: nothing here writes into it
    return view
  x = np.asarray(x)
  if x.dtype.kind == "V" and x.dtype.itemsize == 2:  # bfloat16 via np.savez
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    x = x.view(ml_dtypes.bfloat16)
  return x


def owned(tree):
  """The tree with no numpy leaf in a torch tensor's memory: a leaf that is
  a view of one (a state dict read with ``to_numpy(copy=False)``; its
  ``base`` chain ends at the tensor) is copied, every other leaf kept as
  it is (arrays made here, such as stacked layers, and numpy inputs, as
  :func:`to_numpy` keeps them). Each tensor is copied at most once on its
  way from a state dict."""
  def own(x):
    if not isinstance(x, np.ndarray):
      return x
    owner = x
    while isinstance(owner, np.ndarray) and owner.base is not None:
      owner = owner.base
    return np.array(x) if hasattr(owner, "detach") else x  # torch's
  return tree_map(own, tree)


def f32(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(to_numpy(x), dtype=np.float32))


def tree_map(fn: Callable, tree):
  """Maps the leaves of a tree of dicts (no JAX needed)."""
  if isinstance(tree, Mapping):
    return {k: tree_map(fn, v) for k, v in tree.items()}
  return fn(tree)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def unflatten(flat: Mapping[str, Any]) -> dict:
  tree: dict = {}
  for key, value in flat.items():
    node = tree
    *parents, leaf = key.split("/")
    for p in parents:
      node = node.setdefault(p, {})
      if not isinstance(node, dict):
        raise ValueError(f"Key {key!r} nests under a leaf")
    node[leaf] = value
  return tree


def params_of(variables):
  return variables["params"] if "params" in variables else variables


def wrap(variables) -> dict:
  """``{'params': ...}`` for a bare params tree; variables as they are."""
  variables = dict(variables)
  return variables if "params" in variables else {"params": variables}


def _with_transformer(variables, fn):
  is_wrapped = "params" in variables
  p = dict(params_of(variables))
  p["Transformer"] = fn(dict(p["Transformer"]))
  return dict(variables, params=p) if is_wrapped else p


def unstack_layers(variables):
  """Scanned tree (``Transformer/encoderblock`` with a leading layer axis)
  -> per-layer tree (``encoderblock_{i}``); other trees come back as is."""
  if "encoderblock" not in params_of(variables).get("Transformer", {}):
    return variables

  def fn(tr):
    stacked = tr.pop("encoderblock")
    n = len(next(iter(flatten(stacked).values())))
    for i in range(n):
      tr[f"encoderblock_{i}"] = tree_map(lambda x, i=i: x[i], stacked)
    return tr
  return _with_transformer(variables, fn)


def stack_layers(variables):
  """Per-layer tree -> scanned tree (for ``scan_layers=True`` models)."""
  tr = params_of(variables).get("Transformer", {})
  names = sorted((k for k in tr if _BLOCK.match(k)),
                 key=lambda k: int(_BLOCK.match(k).group(1)))
  if not names:
    return variables

  def fn(tr):
    blocks = [flatten(tr.pop(k)) for k in names]
    tr["encoderblock"] = unflatten({
        k: np.stack([np.asarray(b[k]) for b in blocks]) for k in blocks[0]})
    return tr
  return _with_transformer(variables, fn)


def num_layers(params) -> int:
  tr = params["Transformer"]
  if "encoderblock" in tr:
    return int(np.shape(tr["encoderblock"]["LayerNorm_0"]["scale"])[0])
  return len([k for k in tr if _BLOCK.match(k)])


def _is_square(n: int) -> bool:
  if n <= 0:
    return False
  s = int(round(np.sqrt(n)))
  return s * s == n


def arch_of(variables, *, conv_stem=None, patch_size=None,
            image_size=None) -> dict:
  """The :class:`~vit_jax.models.VisionTransformer` fields that a tree in
  our layout (per-layer or scanned) determines: the one place the
  architecture is read back from weights.

  What no tree stores comes from elsewhere: the activation and LayerNorm
  epsilon (the family's), a conv stem's strides (``conv_stem``, else
  inferred from ``patch_size`` as torchvision's published stems have them).
  ``image_size`` (the checkpoint's resolution, when known) settles whether
  the position embedding has rows for the prefix tokens.
  """
  p = params_of(variables)
  missing = [k for k in ("embedding", "Transformer") if k not in p and not (
      k == "embedding" and "mbconv_stem" in p)]  # ViTamin's stem: none
  if missing:
    raise ValueError(f"Not a ViT parameter tree: no {missing} at the top "
                     f"(found {sorted(p)[:10]}).")
  tr = p["Transformer"]
  depth = num_layers(p)
  if not depth:
    raise ValueError("Not a ViT parameter tree: no Transformer/encoderblock_N")
  blk = tr["encoderblock"] if "encoderblock" in tr else tr["encoderblock_0"]
  lead = 1 if "encoderblock" in tr else 0
  shape = lambda x: tuple(np.shape(x))[lead:]  # noqa: E731
  try:
    attn = blk["MultiHeadDotProductAttention_0"]
    q = shape(attn["query"]["kernel"])
    mlp_block = blk["MlpBlock_0"]
    mlp = shape(mlp_block["Dense_0"]["kernel"])[-1]
    mlp_in = shape(mlp_block["Dense_1"]["kernel"])[0]
    norm0 = blk["LayerNorm_0"]
    out = attn["out"]
  except (KeyError, TypeError) as e:
    raise ValueError(f"encoderblock_0 is not a ViT block (missing {e}); it "
                     f"has {sorted(blk)}") from None
  gated = ("split" if "Gate_0" in mlp_block else
           "packed" if mlp == 2 * mlp_in else None)
  mbconv = mbconv_of(p)
  if mbconv is not None:  # its last convolution ends at the width
    emb = (mbconv.stride,) + tuple(np.shape(
        p["mbconv_stem"].get("pool_proj", {}).get("kernel", (0,))))[-1:]
  else:
    emb = np.shape(p["embedding"]["kernel"])
  resnet = resnet_of(p)
  arch: Dict[str, Any] = dict(
      hidden_size=int(emb[-1]), num_layers=depth, num_heads=int(q[1]),
      mlp_dim=int(mlp_in), resnet=resnet, mbconv=mbconv,
      patch_size=int(emb[0]) * (resnet.stride if resnet else 1),
      qkv_bias="bias" in attn["query"],
      key_bias="bias" in attn["key"] or "bias" not in attn["query"],
      proj_bias="bias" in attn["out"],
      patch_bias=mbconv is not None or "bias" in p["embedding"],
      # Any value: loaded weights overwrite the initial scale.
      layer_scale_init=1e-5 if "LayerScale_0" in blk else None,
      pre_norm="pre_norm" in tr, fc_norm="fc_norm" in p,
      final_norm="encoder_norm" in tr or "fc_norm" in p,
      num_registers=int(np.shape(p["registers"])[1]) if "registers" in p else 0,
      # An RMSNorm is a norm with a scale and no bias.
      norm_type="layer" if "bias" in norm0 else "rms",
      patch_norm="embedding_norm" in p, qk_norm="query_ln" in attn,
      attn_norm="inner_norm" in attn, gated_mlp=gated,
      mlp_norm="LayerNorm_0" in mlp_block,
      mlp_input_norm="InputNorm" in mlp_block, distilled="dist" in p,
      abs_pos_embed="posembed_input" in tr,
      # RoPE-Mixed's learned frequencies (other RoPE: only a name says).
      **({"rope": "mixed"} if "rope_freqs" in tr else {}),
      rel_pos_bias=("shared" if "rel_pos_bias" in tr else
                    "block" if "rel_pos_bias" in attn else None),
      talking_heads="proj_l" in attn,
      class_attn_layers=sum(1 for k in tr if _CLASS_BLOCK.match(k)),
      diff_attn=("dual" if "lambda_a" in attn else
                 "qk" if "lambda_q1" in attn else None),
      # Parallel blocks have one norm; a fused one's MLP no output bias.
      parallel=(None if "LayerNorm_1" in blk else
                "fused" if "bias" in out and "bias" not in mlp_block[
                    "Dense_1"] else "split"))
  arch.update(_rel_pos_mlp_of(tr.get("rel_pos_bias",
                                     attn.get("rel_pos_bias", {}))))
  if gated:  # every released SwiGLU gates by SiLU; ViTamin's GeGLU
    arch["act"] = "gelu" if arch["mlp_input_norm"] else "silu"  # by GELU
  if "MAPHead_0" in p:
    arch["classifier"] = "map"
    mh = p["MAPHead_0"]
    try:  # a damaged head is the checker's to report, by name
      heads = int(np.shape(
          mh["MultiHeadDotProductAttention_0"]["query"]["kernel"])[1])
      width = int(np.shape(mh["MlpBlock_0"]["Dense_0"]["kernel"])[-1])
    except (KeyError, TypeError, IndexError):
      heads, width = arch["num_heads"], arch["mlp_dim"]
    arch["map_heads"] = None if heads == arch["num_heads"] else heads
    arch["map_mlp_dim"] = None if width == arch["mlp_dim"] else width
  elif "cls" in p:
    arch["classifier"] = "token"
  else:
    arch["classifier"] = "gap"
  # Stated, so that a name's pooling (DINOv3 averages the patches beside
  # its class token) keeps the token.
  arch["class_token"] = "cls" in p

  stems = sorted((k for k in p if k.startswith("stem_convs_")),
                 key=lambda k: int(k.rsplit("_", 1)[1]))
  if stems:
    pairs = [(int(np.shape(p[k]["kernel"])[-1]), int(np.shape(p[k]["kernel"])[0]))
             for k in stems]
    arch["conv_stem"] = _stem(pairs, conv_stem, patch_size)
    arch["patch_size"] = int(np.prod([c.stride for c in arch["conv_stem"]]))
  else:
    arch["conv_stem"] = None

  head = p.get("head", {}).get("kernel")
  rep = p.get("pre_logits", {}).get("kernel")
  arch["num_classes"] = int(np.shape(head)[-1]) if head is not None else 0
  arch["representation_size"] = (int(np.shape(rep)[-1]) if rep is not None
                                 else None)

  arch.update(_sam_of(p, tr, depth, arch["patch_size"], image_size))

  # The position embedding has a row per patch, and one per prefix token
  # unless the prefix tokens get none (no_embed_class), or only the class
  # token does (transformers' DINOv2 with registers). CaiT's class token
  # joins the patches after the blocks: its embedding covers the patches.
  arch["no_embed_class"] = bool(arch["class_attn_layers"])
  if not arch["abs_pos_embed"] or arch["class_attn_layers"]:
    return arch
  if "pos_y" in tr["posembed_input"]:  # NaFlex, factorized: rows, columns
    rows, cols = (int(np.shape(tr["posembed_input"][k])[1])
                  for k in ("pos_y", "pos_x"))
    # timm's (linear, aspect-preserving) unless the name says otherwise.
    arch.update(naflex="bilinear", naflex_square=True,
                naflex_factorized=True, naflex_grid=(rows, cols))
    return arch
  if "pos_grid" in tr["posembed_input"]:  # NaFlex: a grid resized per image
    shape = np.shape(tr["posembed_input"]["pos_grid"])
    # SigLIP 2's resize unless the name says otherwise (the weights do not).
    arch.update(naflex="bilinear_aa",
                naflex_grid=(int(shape[1]), int(shape[2])))
    return arch
  rows = int(np.shape(tr["posembed_input"]["pos_embedding"])[1])
  prefix = int("cls" in p) + int(arch["distilled"]) + arch["num_registers"]
  grid = None
  if image_size is not None:
    h, w = models.pair(image_size)
    grid = (h // arch["patch_size"]) * (w // arch["patch_size"])
  if grid is not None and rows in (grid, grid + prefix):
    no_embed_class = rows == grid and prefix > 0
  else:  # only the patch rows form a square grid
    no_embed_class = (prefix > 0 and _is_square(rows) and
                      not _is_square(rows - prefix))
  arch["no_embed_class"] = bool(no_embed_class)
  registers = arch["num_registers"]
  if (not no_embed_class and registers and prefix - registers > 0 and
      ((grid is not None and rows == grid + prefix - registers) or
       (grid is None and _is_square(rows - prefix + registers) and
        not _is_square(rows - prefix)))):
    arch["no_embed_registers"] = True
  return arch


def _rel_pos_mlp_of(module) -> Dict[str, Any]:
  """``rel_pos_mlp`` and its width from a relative position bias module
  (a table, or timm's MLP: ``Dense_0``, ``Dense_1`` with a bias but in
  Swin v2's mode)."""
  if "Dense_0" not in module:
    return dict(rel_pos_mlp=None)
  return dict(rel_pos_mlp="cr" if "bias" in module.get("Dense_1", {})
              else "swin",
              rel_pos_mlp_dim=int(np.shape(module["Dense_0"]["kernel"])[-1]))


def _sam_of(p, tr, depth: int, patch: int, image_size) -> Dict[str, Any]:
  """SAM's fields a tree shows: ``neck_chans`` (the neck's width),
  ``rel_pos`` (tables in the attention), and ``window_size`` /
  ``global_attn_indexes`` where the tables show them: a global block's
  have ``2 * g - 1`` rows for the patch grid ``g`` the model was made for
  (the square of the position embedding's rows, else ``image_size``'s),
  a windowed block's ``2 * window - 1``. Where every table is the grid's
  (a window as large as the grid: the same function at that size) no
  window is read (a name gives it)."""
  out: Dict[str, Any] = dict(window_size=0, global_attn_indexes=(),
                             rel_pos=False, neck_chans=None)
  conv = p.get("neck", {}).get("Conv_0", {}).get("kernel")
  if conv is not None:
    out["neck_chans"] = int(np.shape(conv)[-1])
  stacked = tr.get("encoderblock", {}).get("MultiHeadDotProductAttention_0",
                                          {})
  if "rel_pos_h" in stacked:  # scanned: tables of one length in every block
    out["rel_pos"] = True
    return out
  rows = []
  for i in range(depth):
    attn = tr.get(f"encoderblock_{i}", {}).get(
        "MultiHeadDotProductAttention_0", {})
    if "rel_pos_h" not in attn or "rel_pos_w" not in attn:
      break
    rows.append((int(np.shape(attn["rel_pos_h"])[0]),
                 int(np.shape(attn["rel_pos_w"])[0])))
  if not rows:
    return out
  out["rel_pos"] = True
  grid = None
  pos = tr.get("posembed_input", {}).get("pos_embedding")
  if pos is not None and "cls" not in p and _is_square(np.shape(pos)[1]):
    side = int(round(np.sqrt(np.shape(pos)[1])))
    grid = (side, side)
  elif image_size is not None:
    h, w = models.pair(image_size)
    grid = (h // patch, w // patch)
  if grid is None or len(rows) != depth:
    return out
  full = (2 * grid[0] - 1, 2 * grid[1] - 1)
  windowed = {i: r for i, r in enumerate(rows) if r != full}
  sides = {r for r in windowed.values()}
  if len(sides) != 1:  # none, or tables of several sizes: the checker's
    return out
  (rh, rw), = sides
  if rh != rw or rh % 2 == 0:
    return out
  out.update(window_size=(rh + 1) // 2, global_attn_indexes=tuple(
      i for i in range(depth) if i not in windowed))
  return out


def patch_size_of(params) -> int:
  """The pixels per token of a tree without a conv or ResNet stem: its
  patch embedding's kernel, or ViTamin's stem's reduction."""
  params = params_of(params)
  if "mbconv_stem" in params:
    return models.MbConvConfig.stride
  return int(np.shape(params["embedding"]["kernel"])[0])


_MB_BLOCK = re.compile(r"^stage(\d+)_block(\d+)$")


def mbconv_of(params) -> Optional["models.MbConvConfig"]:
  """ViTamin's stem from its parameters (``mbconv_stem``: the stem
  convolutions' width, each stage's blocks and output width), or None."""
  stem = params.get("mbconv_stem")
  if stem is None:
    return None
  blocks: Dict[int, List[int]] = {}
  for k in stem:
    m = _MB_BLOCK.match(k)
    if m:
      blocks.setdefault(int(m.group(1)), []).append(int(m.group(2)))
  if sorted(blocks) != [0, 1] or any(
      sorted(u) != list(range(len(u))) for u in blocks.values()):
    raise ValueError(f"ViTamin's stem has two stages of blocks stage{{s}}_"
                     f"block{{u}} (from 0); this tree has "
                     f"{sorted(k for k in stem if _MB_BLOCK.match(k))}")

  def out(*path):  # a conv kernel's output channels (damaged: the checker's)
    node = stem
    for k in path:
      node = node.get(k, {}) if isinstance(node, Mapping) else {}
    kernel = node.get("kernel") if isinstance(node, Mapping) else None
    return int(np.shape(kernel)[-1]) if np.ndim(kernel) == 4 else 0
  return models.MbConvConfig(
      stem_width=out("stem_conv1"),
      widths=tuple(out(f"stage{s}_block0", "conv3") for s in (0, 1)),
      depths=tuple(len(blocks[s]) for s in (0, 1)))


_STAGE = re.compile(r"^block(\d+)$")
_UNIT = re.compile(r"^unit(\d+)$")


def resnet_of(params) -> Optional["models.ResNetConfig"]:
  """A hybrid's ResNet stem from its parameters (``conv_root``,
  ``block{s}/unit{u}``), or None. The constants are Google's
  (:data:`vit_jax.models.resnet.GOOGLE`): our tree is Google's, so a tree
  with nothing else said is its module's; a layout of another library
  states its own (timm's table: ``fixed``)."""
  if "conv_root" not in params:
    return None
  kernel = params["conv_root"].get("kernel")
  # (A damaged kernel is the checker's to report, by name.)
  width = int(np.shape(kernel)[-1]) if np.ndim(kernel) == 4 else 64
  stages = sorted(int(_STAGE.match(k).group(1)) for k in params
                  if _STAGE.match(k))
  if stages != list(range(1, len(stages) + 1)):
    raise ValueError(f"A ResNet stem's stages are block1, block2, ...; this "
                     f"tree has {['block%d' % s for s in stages]}")
  depths = []
  for s in stages:
    units = sorted(int(_UNIT.match(k).group(1))
                   for k in params[f"block{s}"] if _UNIT.match(k))
    if not units or units != list(range(1, len(units) + 1)):
      raise ValueError(f"block{s}: a ResNet stage's units are unit1, unit2, "
                       f"...; it has {sorted(params[f'block{s}'])}")
    depths.append(len(units))
  factor = width / 64
  return models.ResNetConfig(
      num_layers=tuple(depths),
      width_factor=int(factor) if factor == int(factor) else factor,
      **models.resnet.GOOGLE)


def native_image_size(variables, model) -> Optional[int]:
  """The square input size the position embedding (or, without one, a
  relative position table) was made for (None when its patch rows do not
  form a square, or there is none)."""
  p = params_of(variables)
  if "pos_embedding" not in p["Transformer"].get("posembed_input", {}):
    table = rel_pos_table(p)
    grid = None if table is None else relpos.grid_of_rows(
        int(np.shape(table)[-2]), class_token="cls" in p)
    return None if grid is None else grid[0] * model.patch_size
  rows = int(np.shape(p["Transformer"]["posembed_input"]["pos_embedding"])[1])
  patches = rows - pos_prefix_rows(model)
  side = int(round(np.sqrt(max(patches, 0))))
  return side * model.patch_size if side * side == patches else None


def rel_pos_table(params):
  """A relative position table of the tree (the shared one, else the
  first block's), or None."""
  tr = params["Transformer"]
  if "rel_pos_bias" in tr:
    return tr["rel_pos_bias"].get("table")
  blk = tr.get("encoderblock", tr.get("encoderblock_0", {}))
  attn = blk.get("MultiHeadDotProductAttention_0", {})
  return attn.get("rel_pos_bias", {}).get("table")


def pos_prefix_rows(model) -> int:
  """The rows of ``model``'s position embedding that are not patches."""
  if model.no_embed_class:
    return 0
  if model.no_embed_registers:
    return model.num_prefix_tokens - model.num_registers
  return model.num_prefix_tokens


def _stem(pairs, conv_stem, patch_size):
  """Conv-stem layers from the weights' (out_channels, kernel) pairs and the
  given strides (checked against the pairs), or strides inferred."""
  if conv_stem is None:
    if patch_size is None:
      raise ValueError("This tree has a conv stem, whose strides are not "
                       "stored in weights: pass conv_stem (or the variant "
                       "name, which gives the patch size).")
    return infer_stem_strides(
        [models.ConvStemConfig(c, k, 1) for c, k in pairs], patch_size)
  given = [c if isinstance(c, models.ConvStemConfig)
           else models.ConvStemConfig(*c) for c in conv_stem]
  if [(c.out_channels, c.kernel_size) for c in given] != pairs:
    raise ValueError(
        f"conv_stem (out_channels, kernel_size) per layer "
        f"{[(c.out_channels, c.kernel_size) for c in given]} does not match "
        f"the weights' stem {pairs}.")
  return tuple(given)


def infer_stem_strides(stem, patch_size: int):
  """torchvision's published conv stems halve the resolution per layer:
  strides 2 until they multiply to the patch size, 1 afterwards."""
  out, total = [], 1
  for c in stem:
    s = 2 if total < patch_size else 1
    out.append(models.ConvStemConfig(c.out_channels, c.kernel_size, s))
    total *= s
  if stem and total != patch_size:
    raise ValueError(
        f"Cannot infer conv-stem strides: {len(stem)} stride-2 layers give "
        f"{total}, not the patch size {patch_size}. Pass the stem with its "
        f"strides: conv_stem=[ConvStemConfig(out_channels, kernel_size, "
        f"stride), ...].")
  return tuple(out)


def describe(arch: Mapping[str, Any], name: Optional[str] = None,
             image_size: Optional[int] = None, head: str = "classes") -> str:
  """One line: ``vit_b_16 (width 768, 12 layers, 12 heads, MLP 3072, ...)``."""
  parts = [f"width {arch.get('hidden_size')}", f"{arch.get('num_layers')} layers",
           f"{arch.get('num_heads')} heads", f"MLP {arch.get('mlp_dim')}",
           f"patch {arch.get('patch_size')}"]
  if arch.get("conv_stem"):
    parts.append(f"conv stem of {len(arch['conv_stem'])} layers")
  if arch.get("mbconv"):
    c = models.mbconv.as_config(arch["mbconv"])
    parts.append(f"ViTamin stem (width {c.stem_width}, stages "
                 f"{tuple(c.widths)} x {tuple(c.depths)})")
  if arch.get("mlp_input_norm"):
    parts.append("a norm of the MLP's input")
  if arch.get("resnet"):
    r = models.resnet.as_config(arch["resnet"])
    parts.append(f"ResNet stem {tuple(r.num_layers)}" if r.num_layers
                 else "ResNet root block")
  if arch.get("classifier", "token") != "token":
    parts.append(f"classifier {arch['classifier']!r}")
  for key, what in (("num_registers", "registers"),):
    if arch.get(key):
      parts.append(f"{arch[key]} {what}")
  if arch.get("rope"):
    parts.append(f"RoPE {arch['rope']!r}")
  if arch.get("rel_pos_bias"):
    mlp = (f", MLP {arch['rel_pos_mlp']!r} of width "
           f"{arch.get('rel_pos_mlp_dim', 128)}" if arch.get("rel_pos_mlp")
           else "")
    parts.append(f"relative position bias ({arch['rel_pos_bias']}{mlp})")
  if arch.get("naflex"):
    grid = arch.get("naflex_grid") or (16, 16)
    what = "factorized " if arch.get("naflex_factorized") else ""
    parts.append(f"NaFlex ({arch['naflex']} from a {what}{grid[0]}x{grid[1]} "
                 f"grid{', square' if arch.get('naflex_square') else ''})")
  if arch.get("gated_mlp"):
    parts.append(f"gated MLP ({arch['gated_mlp']})")
  if arch.get("window_size"):
    parts.append(f"windows of {arch['window_size']} but blocks "
                 f"{list(arch.get('global_attn_indexes') or ())}")
  if arch.get("rel_pos"):
    parts.append("decomposed relative positions")
  if arch.get("neck_chans"):
    parts.append(f"SAM neck {arch['neck_chans']}")
  if arch.get("talking_heads"):
    parts.append("talking heads")
  if arch.get("diff_attn"):
    parts.append(f"differential attention ({arch['diff_attn']})")
  if arch.get("parallel"):
    parts.append(f"parallel blocks ({arch['parallel']})")
  if arch.get("class_attn_layers"):
    parts.append(f"{arch['class_attn_layers']} class-attention blocks")
  if arch.get("norm_type", "layer") != "layer":
    parts.append(f"{arch['norm_type']} norm")
  for key in ("layer_scale_init", "pre_norm", "fc_norm", "no_embed_class",
              "distilled", "patch_norm", "qk_norm", "mlp_norm"):
    if arch.get(key):
      parts.append(key.replace("_init", "").replace("_", " "))
  if arch.get("abs_pos_embed", True) is False:
    parts.append("no position embedding")
  if arch.get("act", "gelu") != "gelu":
    parts.append(arch["act"])
  if arch.get("representation_size"):
    parts.append(f"pre_logits {arch['representation_size']}")
  if head == "embedding":
    parts.append(f"a {arch.get('num_classes')}-d embedding head")
  else:
    parts.append(f"{arch.get('num_classes') or 'no'} classes")
  if image_size:
    parts.append(f"{image_size}px")
  return f"{name or models.variant_name(arch) or 'a ViT'} ({', '.join(parts)})"
