"""Shared fixtures for the Ray / sweep / cluster tests (import them into a test module).

One local Ray cluster per test session (``ray.init(address="local", num_cpus=2)``, no
dashboard). Defined once here; a module that imports :func:`ray_local` reuses the running
cluster if another module already started it.
"""

from __future__ import annotations

import os

import pytest

RAY_TEST_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_test_env() -> None:
    for k, v in RAY_TEST_ENV.items():
        os.environ.setdefault(k, v)


@pytest.fixture(scope="session")
def ray_local():
    """A running local Ray cluster (2 CPUs, no dashboard), shared by the whole session."""
    apply_test_env()
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved 4-layer random Llama (fp32, no EOS) and its tokenizer, that shard actors load from disk."""
    from tests.helpers import tiny_llama, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
