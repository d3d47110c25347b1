"""``Llama.from_pretrained``'s download, as llama-cpp-python 0.3.36 does it: the repository's files listed
through ``huggingface_hub`` (an optional package, as there), the one that matches ``filename`` (a name or a
glob) fetched with its ``additional_files`` (a split model's other shards), and its local path given to
``Llama``. Where the Hub cannot be reached, huggingface_hub's own error says so; a file already in its
cache is found with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Any


def hub_model_path(repo_id: str, filename: str, additional_files: list[str] | None = None,
                   local_dir: str | os.PathLike[str] | None = None, local_dir_use_symlinks: Any = "auto",
                   cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The local path of ``repo_id``'s file matching ``filename``, downloaded (with the files matching
    ``additional_files``) if it is not there yet. ValueError when no file, or more than one, matches."""
    try:
        from huggingface_hub import HfFileSystem, hf_hub_download
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise ImportError("Llama.from_pretrained requires the huggingface-hub package. "
                          "You can install it with `pip install huggingface-hub`.") from None
    validate_repo_id(repo_id)
    files = [f["name"] if isinstance(f, dict) else f for f in HfFileSystem().ls(repo_id, recursive=True)]
    in_repo = [str(Path(f).relative_to(repo_id)) for f in files]

    def fetch(pattern: str, **more: Any) -> str:
        matching = [f for f in in_repo if fnmatch.fnmatch(f, pattern)]
        if not matching:
            raise ValueError(f"No file found in {repo_id} that match {pattern}\n\nAvailable Files:\n{json.dumps(in_repo)}")
        if len(matching) > 1:
            raise ValueError(f"Multiple files found in {repo_id} matching {pattern}\n\n"
                             f"Available Files:\n{json.dumps(files)}")
        subfolder = str(Path(matching[0]).parent)
        return hf_hub_download(repo_id=repo_id, filename=Path(matching[0]).name,
                               subfolder=None if subfolder == "." else subfolder, local_dir=local_dir,
                               local_dir_use_symlinks=local_dir_use_symlinks, cache_dir=cache_dir, **more)

    fetch(filename)
    for pattern in additional_files or ():
        fetch(pattern)
    # (llama-cpp-python joins local_dir and the file's name, leaving out a subfolder: the path the
    # download gives is used here, the same file where there is none)
    return fetch(filename, local_files_only=True)
