"""Reading and writing weight files, never through pickle.

* ``.pth`` / ``.pt`` / ``.bin``: ``torch.load(weights_only=True)``;
* ``.safetensors``: the safetensors library (numpy, no torch needed);
* ``.npz``: ``np.load(allow_pickle=False)``;
* Hugging Face Hub repos (``hf-hub:org/name[@revision]``): their
  ``config.json`` and ``model.safetensors`` through ``huggingface_hub``
  (pickled ``pytorch_model.bin`` files are refused); offline, from the
  local cache only, failing at once with what to fetch;
* torchvision's released weights: downloaded and hash-checked by torch.hub.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from vit_jax.data import net
from vit_jax.weights import trees

HF_PREFIXES = ("hf-hub:", "hf_hub:")


TORCH_EXTS = (".pth", ".pt", ".bin", ".ckpt")


def needs_torch(source: str) -> bool:
  """Whether reading ``source`` imports torch: a pickled state dict or
  torchvision's released weights (everything else is read with numpy)."""
  source = str(source)
  return (source.startswith("torchvision:") or
          os.path.splitext(source)[1].lower() in TORCH_EXTS)


def _import_torch(path: str):
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(
        f"Reading {path!r} (a PyTorch pickle file) needs PyTorch: pip install "
        f"torch. Or convert it where torch is installed: python -m "
        f"vit_jax.weights {path} OUT.safetensors") from None
  return torch


def read_torch(path: str) -> Dict[str, np.ndarray]:
  """A ``.pth``/``.pt``/``.bin`` state dict as numpy arrays, read with
  ``torch.load(weights_only=True)``; unwraps training checkpoints'
  ``{'model': ...}`` / ``{'state_dict': ...}``. A damaged file and a file
  holding pickled code get different errors."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No such checkpoint file: {path!r}")
  torch = _import_torch(path)
  try:
    obj = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # pickle.UnpicklingError and friends
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # torch's bold text
    if "Weights only load failed" in text and not _damaged_torch_file(path):
      what = next((l.strip() for l in text.splitlines()
                   if "Unsupported global" in l or "GLOBAL" in l), "")
      raise ValueError(
          f"Cannot read {path!r} as a plain tensor state dict with "
          f"torch.load(weights_only=True): it holds pickled objects other "
          f"than tensors, which are refused because loading them runs code."
          + (f" ({what})" if what else "")) from e
    raise ValueError(
        f"{path!r} is damaged or truncated ({os.path.getsize(path):,} bytes): "
        f"not a complete PyTorch checkpoint ({type(e).__name__}: "
        f"{text.splitlines()[0] if text else e!r}). Download or copy it "
        f"again.") from e
  return unwrap(obj, f"a state dict in {path!r}")


def _damaged_torch_file(path: str) -> bool:
  """True when ``path`` is not a whole torch checkpoint: a zip archive
  (torch's format since 1.6) whose central directory, at the end, is
  missing or broken, or a legacy pickle that ends early."""
  import pickletools  # pylint: disable=import-outside-toplevel
  import zipfile  # pylint: disable=import-outside-toplevel

  with open(path, "rb") as f:
    head = f.read(4)
  if head.startswith(b"PK"):
    if not zipfile.is_zipfile(path):
      return True
    try:
      with zipfile.ZipFile(path) as z:
        return z.testzip() is not None
    except (zipfile.BadZipFile, OSError, EOFError):
      return True
  try:
    with open(path, "rb") as f:
      for _ in pickletools.genops(f):
        pass
  except Exception:  # pylint: disable=broad-except
    return True
  return False


def unwrap(obj, what: str = "a state dict", copy: bool = True
           ) -> Dict[str, Any]:
  """A state dict from what people save: a torch module, a training
  checkpoint ``{'model': ..., 'optimizer': ...}``, or the dict itself.
  ``copy=False``: torch tensors read through read-only views
  (:func:`trees.to_numpy`)."""
  if hasattr(obj, "state_dict") and callable(obj.state_dict):
    obj = obj.state_dict()
  if not isinstance(obj, Mapping):
    raise TypeError(f"Expected {what} (a mapping of names to tensors), got "
                    f"{type(obj).__name__}")
  for key in ("model", "state_dict", "model_state_dict", "module"):
    if key in obj and isinstance(obj[key], Mapping):
      obj = obj[key]
      break
  return {k: trees.to_numpy(v, copy) for k, v in obj.items()
          if hasattr(v, "shape") or isinstance(v, (int, float, np.ndarray))}


def read_safetensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """``(arrays, metadata)`` of a safetensors file; metadata values that are
  JSON are decoded. A truncated file says so, with its size and the size
  its header promises."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(path):
    raise FileNotFoundError(f"No such checkpoint file: {path!r}")
  _check_safetensors_size(path)
  try:
    with safe_open(path, framework="numpy") as f:
      meta = dict(f.metadata() or {})
      arrays = {k: f.get_tensor(k) for k in f.keys()}
  except Exception as e:  # safetensors raises its own error types
    raise ValueError(f"Cannot read {path!r} as a safetensors file: {e}") from None
  decoded = {}
  for k, v in meta.items():
    try:
      decoded[k] = json.loads(v)
    except (TypeError, ValueError):
      decoded[k] = v
  return arrays, decoded


def _check_safetensors_size(path: str) -> None:
  """The file holds what its header says: 8 bytes of header length, the
  JSON header, then every tensor's bytes (``data_offsets``)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    first = f.read(8)
    if len(first) < 8:
      raise ValueError(f"{path!r} is not a safetensors file: {size} bytes, "
                       f"less than its 8-byte header length.")
    n = int.from_bytes(first, "little")
    if n > size - 8:
      raise ValueError(
          f"{path!r} is truncated ({size:,} bytes): its header alone is "
          f"{n + 8:,} bytes (or it is not a safetensors file). Download or "
          f"copy it again.")
    try:
      header = json.loads(f.read(n))
    except ValueError:
      raise ValueError(f"{path!r} is not a safetensors file (or is damaged): "
                       f"its header is not JSON.") from None
  ends = [int(v["data_offsets"][1]) for k, v in header.items()
          if k != "__metadata__" and isinstance(v, dict)
          and "data_offsets" in v]
  want = 8 + n + max(ends, default=0)
  if size < want:
    raise ValueError(
        f"{path!r} is truncated ({size:,} of {want:,} bytes, as its header "
        f"says). Download or copy it again.")


def write_safetensors(arrays: Mapping[str, np.ndarray], path: str,
                      metadata: Optional[Mapping[str, Any]] = None) -> None:
  """Writes arrays (bit for bit) with JSON-encoded metadata values."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  meta = {k: v if isinstance(v, str) else json.dumps(v)
          for k, v in (metadata or {}).items()}
  save_file({k: np.ascontiguousarray(trees.to_numpy(v))
             for k, v in arrays.items()}, path, metadata=meta)


def read_npz(path: str) -> Dict[str, np.ndarray]:
  """All arrays of an ``.npz`` file, read with ``allow_pickle=False``."""
  try:
    with np.load(path, allow_pickle=False) as f:
      if not hasattr(f, "files"):
        raise ValueError("it holds a single array (.npy), not named arrays")
      return {k: f[k] for k in f.files}
  except FileNotFoundError:
    raise FileNotFoundError(f"No such checkpoint file: {path!r}") from None
  except ValueError as e:
    raise ValueError(f"Cannot read {path!r} as an .npz of arrays without "
                     f"pickle: {e}") from None
  except (OSError, EOFError) as e:
    raise ValueError(f"Cannot read {path!r} as an .npz file: {e}") from None


def read_json(path: str) -> Dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"Cannot read {path!r} as JSON: {e}") from None


# --------------------------------------------------------------------------- #
# Directories and the Hugging Face Hub.
# --------------------------------------------------------------------------- #

WEIGHT_FILES = ("model.safetensors", "open_clip_model.safetensors")


_PICKLED = ("pytorch_model.bin", "open_clip_pytorch_model.bin")


def is_model_dir(path: str) -> bool:
  """A Hugging Face model directory (config.json beside weights), as opposed
  to a training workdir (which has a config.json of its own)."""
  return (os.path.isfile(os.path.join(path, "config.json")) and
          not os.path.isdir(os.path.join(path, "checkpoints")) and
          any(os.path.isfile(os.path.join(path, n))
              for n in WEIGHT_FILES + _PICKLED))


def read_model_dir(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any],
                                        Dict[str, Any]]:
  """A directory as ``save_pretrained`` / timm's hub push lays it out:
  ``(arrays, config.json, preprocessor_config.json or {})``."""
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config):
    raise FileNotFoundError(
        f"{path!r} has no config.json: expected a Hugging Face model "
        f"directory (config.json + model.safetensors).")
  for name in WEIGHT_FILES:
    if os.path.isfile(os.path.join(path, name)):
      arrays, _ = read_safetensors(os.path.join(path, name))
      break
  else:
    pickled = [n for n in _PICKLED if os.path.isfile(os.path.join(path, n))]
    raise FileNotFoundError(
        f"{path!r} has no model.safetensors" + (
            f" (only {pickled[0]}, a pickle, which is not loaded: convert it "
            f"to safetensors first)" if pickled else "") + ".")
  pre = os.path.join(path, "preprocessor_config.json")
  return arrays, read_json(config), (read_json(pre) if os.path.isfile(pre)
                                     else {})


def parse_hub_name(source: str) -> Tuple[str, Optional[str]]:
  """``hf-hub:org/name[@revision]`` -> (repo id, revision or None)."""
  name = source.split(":", 1)[1]
  repo, _, revision = name.partition("@")
  if repo.count("/") != 1 or not all(repo.split("/")):
    raise ValueError(f"{source!r}: expected hf-hub:<org>/<name>[@revision], "
                     f"e.g. hf-hub:timm/vit_base_patch14_reg4_dinov2.lvd142m")
  return repo, revision or None


def hub_dir(source: str) -> str:
  """Fetches (or, offline, finds in the local cache) the config and
  safetensors weights of ``hf-hub:org/name`` and returns their directory.

  Offline (``HF_HUB_OFFLINE=1``, or the Hub's host does not answer a quick
  probe) only the local cache is read: a repo that is not there fails at
  once, naming the cache, the ``hf download`` command and
  ``HF_HUB_OFFLINE``, instead of after huggingface_hub's retries."""
  from huggingface_hub import constants, hf_hub_download  # pylint: disable=import-outside-toplevel
  from huggingface_hub.errors import (  # pylint: disable=import-outside-toplevel
      EntryNotFoundError, LocalEntryNotFoundError)
  import urllib.parse  # pylint: disable=import-outside-toplevel

  repo, revision = parse_hub_name(source)
  offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true",
                                                               "yes", "on")
  host = urllib.parse.urlparse(constants.ENDPOINT).hostname or "huggingface.co"
  local = offline or not net.online(host, timeout=3.0)
  try:
    config = hf_hub_download(repo, "config.json", revision=revision,
                             local_files_only=local)
  except LocalEntryNotFoundError as e:
    why = ("HF_HUB_OFFLINE is set" if offline else
           f"{host} cannot be reached (set HF_HUB_OFFLINE=1 to skip that "
           f"check)")
    raise FileNotFoundError(
        f"config.json of {repo} is not in the local Hugging Face cache "
        f"({_cache_dir()}) and {why}. Fetch it on a machine with internet "
        f"access with\n"
        f"    hf download {repo} config.json model.safetensors "
        f"preprocessor_config.json\nand copy the cache here (or pass the "
        f"downloaded directory itself; HF_HUB_CACHE names another cache). "
        f"({type(e).__name__})") from None
  except Exception as e:  # repository not found, gated, network errors
    raise FileNotFoundError(f"cannot fetch {repo} from the Hugging Face Hub: "
                            f"{type(e).__name__}: {e}") from None
  folder = os.path.dirname(config)
  for name in WEIGHT_FILES + ("preprocessor_config.json",):
    try:
      hf_hub_download(repo, name, revision=revision, local_files_only=local)
    except (EntryNotFoundError, LocalEntryNotFoundError):
      continue  # not every repo has every file
    except Exception:  # pylint: disable=broad-except
      continue  # e.g. offline without that optional file
  if not any(os.path.isfile(os.path.join(folder, n)) for n in WEIGHT_FILES):
    raise FileNotFoundError(
        f"{repo} has no model.safetensors in the cache or on the Hub. Only "
        f"safetensors weights are loaded (a pytorch_model.bin is a pickle); "
        f"fetch it with: hf download {repo} model.safetensors")
  return folder


def _cache_dir() -> str:
  try:
    from huggingface_hub import constants  # pylint: disable=import-outside-toplevel
    return str(constants.HF_HUB_CACHE)
  except ImportError:
    return "~/.cache/huggingface/hub"


# --------------------------------------------------------------------------- #
# torchvision's released weights.
# --------------------------------------------------------------------------- #


def torch_after_tensorflow() -> None:
  """Lets torchvision and timm import after TensorFlow. Both import triton
  (torch's GPU kernel compiler), whose native library kills a process that
  has TensorFlow's loaded (a segfault at import). vit_jax runs the PyTorch
  libraries on the CPU (conversions, reference models), where triton has
  nothing to do: with TensorFlow loaded and triton not yet, triton is
  marked absent, and torch behaves as on a machine without it. Called
  before every import of torchvision or timm."""
  if "tensorflow" in sys.modules and "triton" not in sys.modules:
    sys.modules["triton"] = None  # import triton -> ImportError, no crash


def torchvision_weights(name: str, weights: str):
  """torchvision's weights enum entry ``<name>_Weights.<weights>``."""
  torch_after_tensorflow()
  import torchvision  # pylint: disable=import-outside-toplevel

  enum_name = name.upper().replace("VIT_", "ViT_") + "_Weights"
  try:
    return torchvision.models.get_weight(f"{enum_name}.{weights}")
  except (ValueError, KeyError, AttributeError) as e:
    raise ValueError(
        f"torchvision has no weights {weights!r} for {name} ({e}). Pass one "
        f"of torchvision's names (e.g. 'IMAGENET1K_V1', "
        f"'IMAGENET1K_SWAG_E2E_V1') or a path to a .pth file.") from None


def download_torchvision(enum) -> Dict[str, np.ndarray]:
  """The state dict of a torchvision weights entry (torch.hub's cache,
  hash-checked, ``weights_only=True``); fails fast offline."""
  import urllib.parse  # pylint: disable=import-outside-toplevel

  import torch  # pylint: disable=import-outside-toplevel

  cached = os.path.join(torch.hub.get_dir(), "checkpoints",
                        os.path.basename(enum.url))
  if not os.path.exists(cached):
    host = urllib.parse.urlparse(enum.url).hostname
    if not net.online(host):
      raise FileNotFoundError(
          f"torchvision weights {enum} are not cached at {cached!r} and "
          f"{host} cannot be reached (offline?). Download {enum.url} to that "
          f"path, or pass the .pth file itself.")
  return unwrap(torch.hub.load_state_dict_from_url(
      enum.url, progress=True, check_hash=True, weights_only=True))
