"""A Hugging Face hub cache written by the tests: `models--org--name/snapshots/<commit>/` holding
a model directory's files, and `refs/<branch>` naming the commit — what huggingface_hub reads
with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def add_snapshot(
    cache: Path, repo_id: str, model_dir: Path, commit: str, refs: tuple[str, ...] = ("main",)
) -> Path:
    """Copy `model_dir` into `cache` as `repo_id`'s snapshot `commit`, named by `refs`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads it whole
    return snapshot
