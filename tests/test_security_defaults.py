"""Security defaults, checked on the shipped files: a serve config either binds loopback or needs an
API key; the multi-node cluster keeps the dashboard/job server on 127.0.0.1 and its MLflow server
behind basic auth; ``/metrics`` needs the key whenever one is set (tests/test_serve.py)."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest
import yaml

from cluster.serve_config import ConfigError, ServeConfig, load_serve_config

RAY_CONFIGS = Path(__file__).resolve().parent.parent / "ray_configs"
SERVE_CONFIGS = sorted(p for p in RAY_CONFIGS.glob("*.yaml")
                       if "host" in (yaml.safe_load(p.read_text()) or {}) or p.name.startswith("serve"))


def _loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def test_there_are_serve_configs_to_check():
    assert {"serve_local.yaml", "serve_cluster.yaml", "serve_adaptive.yaml"} <= {p.name for p in SERVE_CONFIGS}


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_serve_config_binds_loopback_or_requires_a_key(path):
    cfg = load_serve_config(path)
    assert _loopback(cfg.host) or cfg.api_key, f"{path.name}: host {cfg.host} without api_key"


def test_an_exposed_host_without_a_key_is_refused():
    for host in ("0.0.0.0", "10.0.0.5", "::"):
        with pytest.raises(ConfigError, match=rf"serve.host '{re.escape(host)}' is reachable .* serve.api_key is required"):
            ServeConfig(model="tiny", host=host, mlflow=False)
    assert ServeConfig(model="tiny", host="0.0.0.0", api_key="k" * 32, mlflow=False).host == "0.0.0.0"
    assert ServeConfig(model="tiny", host="127.0.0.1", mlflow=False).api_key is None


def test_cluster_yaml_keeps_the_job_server_on_loopback_and_mlflow_behind_auth():
    text = (RAY_CONFIGS / "cluster.yaml").read_text()
    starts = [ln for ln in text.splitlines() if "ray start --head" in ln and not ln.lstrip().startswith("#")]
    assert starts and all("--dashboard-host=127.0.0.1" in ln for ln in starts), starts
    servers = [ln for ln in text.splitlines() if "mlflow server" in ln and not ln.lstrip().startswith("#")]
    assert servers
    for ln in servers:
        host = re.search(r"--host\s+(\S+)", ln)
        exposed = host is None or not _loopback(host.group(1))
        assert not exposed or "--app-name basic-auth" in ln, ln


def test_the_local_cluster_binds_loopback_only():
    text = (Path(__file__).resolve().parent.parent / "cluster" / "local_cluster.py").read_text()
    assert '"--node-ip-address", "127.0.0.1"' in text and '"--dashboard-host", "127.0.0.1"' in text
