"""A local Hugging Face Hub cache laid out by huggingface_hub's own
functions (blobs, snapshots, refs), as ``hf_hub_download`` leaves it, so
``hf-hub:`` loading runs its real code path offline."""

import hashlib
import os


def put(cache_dir: str, repo_id: str, folder: str, revision: str = "main"):
  """Copies every file of ``folder`` into ``cache_dir`` as the cached
  snapshot of ``repo_id`` at ``revision``; returns the snapshot path."""
  from huggingface_hub import file_download  # pylint: disable=import-outside-toplevel

  storage = os.path.join(cache_dir, file_download.repo_folder_name(
      repo_id=repo_id, repo_type="model"))
  commit = hashlib.sha1(repo_id.encode()).hexdigest()
  snapshot = os.path.join(storage, "snapshots", commit)
  os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
  os.makedirs(snapshot, exist_ok=True)
  for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name), "rb") as f:
      data = f.read()
    blob = os.path.join(storage, "blobs", hashlib.sha256(data).hexdigest())
    with open(blob, "wb") as f:
      f.write(data)
    file_download._create_symlink(blob, os.path.join(snapshot, name),  # pylint: disable=protected-access
                                  new_blob=True)
  file_download._cache_commit_hash_for_specific_revision(  # pylint: disable=protected-access
      storage, revision, commit)
  return snapshot


def offline(monkeypatch, cache_dir: str):
  """This process reads the Hub only from ``cache_dir`` (HF_HUB_OFFLINE)."""
  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_CACHE", cache_dir)
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
