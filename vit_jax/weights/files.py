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


def read_torch(path: str) -> Dict[str, np.ndarray]:
  """A ``.pth``/``.pt``/``.bin`` state dict as numpy arrays, read with
  ``torch.load(weights_only=True)``; unwraps training checkpoints'
  ``{'model': ...}`` / ``{'state_dict': ...}``."""
  import torch  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(path):
    raise FileNotFoundError(f"No such checkpoint file: {path!r}")
  try:
    obj = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # pickle.UnpicklingError and friends
    raise ValueError(
        f"Cannot read {path!r} as a plain tensor state dict with "
        f"torch.load(weights_only=True): {e}. Checkpoints holding arbitrary "
        f"pickled objects are refused because loading them runs code.") from e
  return unwrap(obj, f"a state dict in {path!r}")


def unwrap(obj, what: str = "a state dict") -> Dict[str, Any]:
  """A state dict from what people save: a torch module, a training
  checkpoint ``{'model': ..., 'optimizer': ...}``, or the dict itself."""
  if hasattr(obj, "state_dict") and callable(obj.state_dict):
    obj = obj.state_dict()
  if not isinstance(obj, Mapping):
    raise TypeError(f"Expected {what} (a mapping of names to tensors), got "
                    f"{type(obj).__name__}")
  for key in ("model", "state_dict", "model_state_dict", "module"):
    if key in obj and isinstance(obj[key], Mapping):
      obj = obj[key]
      break
  return {k: trees.to_numpy(v) for k, v in obj.items()
          if hasattr(v, "shape") or isinstance(v, (int, float, np.ndarray))}


def read_safetensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """``(arrays, metadata)`` of a safetensors file; metadata values that are
  JSON are decoded."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(path):
    raise FileNotFoundError(f"No such checkpoint file: {path!r}")
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
  safetensors weights of ``hf-hub:org/name`` and returns their directory."""
  from huggingface_hub import hf_hub_download  # pylint: disable=import-outside-toplevel
  from huggingface_hub.errors import (  # pylint: disable=import-outside-toplevel
      EntryNotFoundError, LocalEntryNotFoundError)

  repo, revision = parse_hub_name(source)
  offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true",
                                                               "yes", "on")
  try:
    config = hf_hub_download(repo, "config.json", revision=revision)
  except LocalEntryNotFoundError as e:
    raise FileNotFoundError(
        f"config.json of {repo} is not in the local Hugging Face cache "
        f"({_cache_dir()}) and " +
        ("HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached") +
        f". Fetch it on a machine with internet access with\n"
        f"    hf download {repo} config.json model.safetensors "
        f"preprocessor_config.json\nand copy the cache here (or pass the "
        f"downloaded directory itself). ({type(e).__name__})") from None
  except Exception as e:  # repository not found, gated, network errors
    raise FileNotFoundError(f"cannot fetch {repo} from the Hugging Face Hub: "
                            f"{type(e).__name__}: {e}") from None
  folder = os.path.dirname(config)
  for name in WEIGHT_FILES + ("preprocessor_config.json",):
    try:
      hf_hub_download(repo, name, revision=revision)
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
