"""Shared fixtures for the Ray / sweep / cluster tests (import them into a test module).

One local Ray cluster per test session (``ray.init(address="local", num_cpus=2)``, no
dashboard). Defined once here; a module that imports :func:`ray_local` reuses the running
cluster if another module already started it.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def running_cluster(root, head_cpus: int = 1, worker_cpus: tuple[int, ...] = (1,)):
    """A ``cluster.local_cluster`` cluster (``ray start`` per node, the venv's ``ray``) for the block;
    stopped by PID afterwards, and nothing of it may be left running."""
    import sys
    from pathlib import Path

    from cluster.local_cluster import LocalCluster, LocalClusterConfig

    cluster = LocalCluster(LocalClusterConfig(root=root, head_cpus=head_cpus, worker_cpus=worker_cpus,
                                              ray_bin=Path(sys.executable).parent / "ray"))
    cluster.start()
    try:
        yield cluster
    finally:
        left = cluster.stop()
        assert not left, f"processes of the local cluster still running: {left}"


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """A head and one worker node, one CPU each (``cluster.local_cluster``), for one test module
    (``tests/test_multinode_*.py`` import it)."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster
