"""Push an S2Llama checkpoint to the Hugging Face Hub as one commit: weights, config, remote code, model card.

transformers' ``push_to_hub`` writes the files with ``save_pretrained`` and then replaces ``README.md`` with the
card already on the Hub or a generic one, which would drop the S2 card (sparsity table, derivation, numbers).
``push_s2_model`` keeps the S2 card, optionally with this checkpoint's metrics, and goes through the same Hub client
calls (``create_repo``, then a single ``create_commit``), so everything lands atomically.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path


def push_s2_model(
    model,
    repo_id: str,
    *,
    tokenizer=None,
    metrics: Mapping[str, object] | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | None = None,
):
    """Upload ``model`` (and ``tokenizer``) to ``repo_id`` in one commit; returns the Hub's ``CommitInfo``.

    Arguments after ``repo_id`` are those of transformers' ``push_to_hub``, plus ``tokenizer`` (saved alongside)
    and ``metrics`` (``{"name": value}`` for the model card's evaluation section).
    """
    from huggingface_hub import CommitOperationAdd, ModelCard
    from transformers.utils.hub import hf_api

    from .model_card import render_model_card

    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ValueError(f"repo_id must be a non-empty 'namespace/name' string, got {repo_id!r}")
    api = hf_api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        card = ModelCard(render_model_card(model.config, metrics))
        card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *(tags or [])]))
        card.save(folder / "README.md")
        operations = [
            CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
            for path in sorted(folder.rglob("*"))
            if path.is_file()
        ]
        return api.create_commit(
            repo_id=repo_id,
            operations=operations,
            commit_message=commit_message or f"Upload {type(model).__name__}",
            commit_description=commit_description,
            token=token,
            create_pr=create_pr,
            revision=revision,
        )
