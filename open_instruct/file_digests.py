"""What a file or folder a run loads by name is, by content: blake2b of a file's bytes (each file read once per process
while its size and mtime stay the same), and of a folder's files. Resumes compare them (checkpoint.data_identity,
input_identity); a judge keys its reply cache by its folder's (judge.py). Standard library only."""

from __future__ import annotations

import hashlib
import json
import os

_digests: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> blake2b


def file_digest(path: str) -> str:
    """blake2b of a file's bytes (cached while its size and mtime stay the same)."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _digests:
        with open(path, "rb") as f:
            _digests[key] = hashlib.file_digest(f, "blake2b").hexdigest()
    return _digests[key]


def source_files(source: str) -> list[str]:
    """The local files of one source: the file, or every file under a folder, sorted, hidden ones left out; none
    for a hub dataset."""
    if os.path.isfile(source):
        return [os.path.abspath(source)]
    files = []
    if os.path.isdir(source):
        for root, dirs, names in os.walk(source):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # no caches (.cache/huggingface, ...)
            files += [os.path.abspath(os.path.join(root, n)) for n in sorted(names) if not n.startswith(".")]
    return files


def folder_digest(folder: str) -> str:
    """blake2b over a folder's files (source_files: their paths inside it and their digests): its content, whatever
    its path."""
    listing = [(os.path.relpath(path, folder), file_digest(path)) for path in source_files(folder)]
    return hashlib.blake2b(json.dumps(listing).encode()).hexdigest()
