"""A Ray cluster of several nodes on one machine, started as a user starts one: ``ray start``.

``make cluster-local`` starts a head (``ray start --head``) and one worker node (``ray start
--address=...``), each a ``ray start --block`` process in its own process group, with its own
``--num-cpus``, a custom resource (``graftblock_head`` / ``graftblock_worker``) and a node label
``graftblock.node=<name>``, so where an actor landed is observable (``ray.nodes()``, the state
API). Everything binds 127.0.0.1; the dashboard (and so the job server that ``ray job submit``
talks to) is on ``--dashboard-host 127.0.0.1``.

The PIDs go to ``<root>/cluster.json``; ``make cluster-stop`` signals exactly those process groups
and any process still running from this cluster's ``--temp-dir``, never ``ray stop`` (which
would stop every Ray cluster on the machine). A node is lost by killing its raylet by PID
(:meth:`LocalCluster.kill_raylet`) and returns with :meth:`LocalCluster.start_node`.

    python -m cluster.local_cluster start [--root runs/cluster-local] [--head-cpus 1] [--worker-cpus 1]
    python -m cluster.local_cluster status|stop [--root runs/cluster-local]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

STATE_FILE = "cluster.json"
HEAD = "head"
"""Node name of the head; worker nodes are named ``worker``, ``worker2``, ..."""
LABEL_KEY = "graftblock.node"
"""Node label naming each node (``ray start --labels``)."""

_WORKER_PORTS_PER_NODE = 2000
_FIRST_WORKER_PORT = 12000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_resource(name: str) -> str:
    """The custom resource a node named ``name`` offers (1 unit): ask for a fraction to pin an actor there."""
    return f"graftblock_{name}"


@dataclass(frozen=True)
class LocalClusterConfig:
    """Shape of a local cluster. Validated on construction."""

    root: Path = Path("runs/cluster-local")
    """Directory of ``cluster.json`` and the node logs."""
    head_cpus: int = 1
    """``--num-cpus`` of the head. Range [0, 256]."""
    worker_cpus: tuple[int, ...] = (1,)
    """``--num-cpus`` of each worker node (one entry per node). 0 to 8 nodes, each in [0, 256]."""
    start_timeout_s: float = 90.0
    """Longest wait for a node to register (and the head's job server to answer). Range (0, 3600]."""
    ray_bin: Path = field(default_factory=lambda: Path(sys.executable).parent / "ray")
    """The ``ray`` executable (default: the one beside this Python)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "worker_cpus", tuple(self.worker_cpus))
        for name, v in (("head_cpus", self.head_cpus), *((f"worker_cpus[{i}]", c) for i, c in enumerate(self.worker_cpus))):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 256:
                raise ValueError(f"LocalClusterConfig.{name} must be an integer in [0, 256], got {v!r}")
        if len(self.worker_cpus) > 8:
            raise ValueError(f"LocalClusterConfig.worker_cpus holds at most 8 nodes, got {len(self.worker_cpus)}")
        if not 0 < self.start_timeout_s <= 3600:
            raise ValueError(f"LocalClusterConfig.start_timeout_s must be in (0, 3600], got {self.start_timeout_s!r}")


def _env(bin_dir: Path) -> dict[str, str]:
    """The ``ray start`` environment. ``bin_dir`` (the venv's) leads ``PATH``, so a submitted job's
    ``python`` is the venv's. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is Ray's switch for multi-node
    clusters as a whole (it defaults to on except on Windows/macOS); the CI environment sets it to
    0, which makes ``ray start --address`` refuse on Linux too, so it is on here."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    return env


class LocalCluster:
    """Start, inspect, damage and stop a local multi-node Ray cluster; its state lives in ``root``."""

    def __init__(self, config: LocalClusterConfig) -> None:
        self.config = config
        self.root = config.root
        self.state: dict = {}
        if (self.root / STATE_FILE).exists():
            self.state = json.loads((self.root / STATE_FILE).read_text())

    # ------------------------------------------------------------------ state
    @property
    def gcs_address(self) -> str:
        """``127.0.0.1:<port>``: what ``ray.init(address=...)`` and ``ray start --address`` take."""
        return self.state["gcs_address"]

    @property
    def dashboard_url(self) -> str:
        """``http://127.0.0.1:<port>``: the job server (``ray job submit --address``) and state API."""
        return self.state["dashboard_url"]

    @property
    def temp_dir(self) -> str:
        return self.state["temp_dir"]

    def _save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        tmp.replace(self.root / STATE_FILE)

    def node_names(self) -> list[str]:
        return list(self.state.get("nodes", {}))

    def root_pid(self, name: str) -> int:
        """PID of node ``name``'s ``ray start --block`` process (its process-group leader)."""
        return int(self.state["nodes"][name]["pid"])

    def is_running(self, name: str) -> bool:
        try:
            p = psutil.Process(self.root_pid(name))
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, KeyError):
            return False

    def raylet_pid(self, name: str) -> int:
        """PID of node ``name``'s raylet, a child of its ``ray start`` process."""
        for child in psutil.Process(self.root_pid(name)).children(recursive=True):
            try:
                if child.name() == "raylet" or "raylet/raylet" in " ".join(child.cmdline()):
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        raise RuntimeError(f"node {name!r} has no raylet running")

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Start the head, then every worker node; return once all have registered."""
        if self.state and any(self.is_running(n) for n in self.node_names()):
            raise RuntimeError(f"a local cluster from {self.root / STATE_FILE} is still running; stop it first "
                               "(make cluster-stop)")
        self.root.mkdir(parents=True, exist_ok=True)
        gcs_port, dash_port = _free_port(), _free_port()
        self.state = {"gcs_address": f"127.0.0.1:{gcs_port}", "dashboard_url": f"http://127.0.0.1:{dash_port}",
                      "temp_dir": tempfile.mkdtemp(prefix="gbcluster", dir="/tmp"), "nodes": {}}
        head_args = ["--head", "--port", str(gcs_port), "--include-dashboard", "true",
                     "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash_port),
                     "--ray-client-server-port", str(_free_port())]
        try:
            self._start_node(HEAD, self.config.head_cpus, head_args, index=0)
            self._wait_job_server()
            for i, cpus in enumerate(self.config.worker_cpus):
                self.start_node("worker" if i == 0 else f"worker{i + 1}", cpus)
        except BaseException:
            self.stop()
            raise

    def start_node(self, name: str, cpus: int | None = None) -> None:
        """(Re)start worker node ``name`` against the running head; wait until it has registered."""
        if name == HEAD:
            raise ValueError("the head is started by start(); start_node adds or restarts a worker node")
        if name in self.state.get("nodes", {}) and self.is_running(name):
            raise RuntimeError(f"node {name!r} is already running (pid {self.root_pid(name)})")
        known = self.state["nodes"].get(name)
        cpus = known["cpus"] if cpus is None and known else cpus
        if cpus is None:
            raise ValueError(f"node {name!r} is new: give its CPUs")
        index = known["index"] if known else len(self.state["nodes"])
        self._start_node(name, cpus, ["--address", self.gcs_address], index=index)

    def _start_node(self, name: str, cpus: int, role_args: list[str], index: int) -> None:
        lo = _FIRST_WORKER_PORT + index * _WORKER_PORTS_PER_NODE  # disjoint worker-port ranges per node
        cmd = [str(self.config.ray_bin), "start", "--block", *role_args, "--node-ip-address", "127.0.0.1",
               "--num-cpus", str(cpus), "--resources", json.dumps({node_resource(name): 1}),
               "--labels", f"{LABEL_KEY}={name}",
               "--dashboard-agent-listen-port", str(_free_port()), "--runtime-env-agent-port", str(_free_port()),
               "--min-worker-port", str(lo), "--max-worker-port", str(lo + _WORKER_PORTS_PER_NODE - 1),
               "--temp-dir", self.temp_dir, "--disable-usage-stats"]
        log = self.root / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, env=_env(self.config.ray_bin.parent), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.state["nodes"][name] = {"pid": proc.pid, "cpus": cpus, "index": index, "log": str(log),
                                     "resource": node_resource(name)}
        self._save()
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start for node {name!r} exited {proc.returncode}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            if name == HEAD or self.alive_nodes().get(name):
                return
            time.sleep(0.5)
        raise RuntimeError(f"node {name!r} did not register in {self.config.start_timeout_s:g} s; see {log}")

    def _wait_job_server(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if not self.is_running(HEAD):
                raise RuntimeError(f"the head exited:\n{Path(self.state['nodes'][HEAD]['log']).read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"the head's job server did not answer in {self.config.start_timeout_s:g} s")

    def alive_nodes(self) -> dict[str, bool]:
        """``{node name: alive}`` as the head's state API sees them (nodes without our label are left out)."""
        try:
            with urllib.request.urlopen(f"{self.dashboard_url}/api/v0/nodes?limit=100&detail=true",
                                        timeout=5) as r:
                rows = json.loads(r.read())["data"]["result"]["result"]
        except (OSError, KeyError, ValueError):
            return {}
        out: dict[str, bool] = {}
        for row in rows:
            name = (row.get("labels") or {}).get(LABEL_KEY)
            if name is not None:
                out[name] = out.get(name, False) or row.get("state") == "ALIVE"
        return out

    # ------------------------------------------------------------------ damage and stop
    def kill_raylet(self, name: str) -> int:
        """SIGKILL node ``name``'s raylet by its PID (its ``ray start`` then takes the node's other
        processes down); return the PID killed."""
        pid = self.raylet_pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def leftovers(self) -> list[int]:
        """PIDs of processes still running from this cluster's temp dir (workers, agents)."""
        if not self.state.get("temp_dir"):
            return []
        pids = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if p.pid != os.getpid() and self.temp_dir in " ".join(p.info["cmdline"] or []):
                    pids.append(p.pid)
            except psutil.Error:
                continue
        return pids

    def stop_node(self, name: str) -> None:
        """Stop node ``name``: its process group, then anything left of its process tree."""
        try:
            leader = psutil.Process(self.root_pid(name))
            tree = [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.root_pid(name), sig)
            except (ProcessLookupError, PermissionError):
                pass
            for p in tree:
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
            _, alive = psutil.wait_procs(tree, timeout=10)
            if not alive:
                break

    def stop(self) -> list[int]:
        """Stop every node this cluster started, by PID; return the PIDs that would not die."""
        if not self.state:
            return []
        for name in reversed(self.node_names()):
            self.stop_node(name)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.leftovers():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while self.leftovers() and time.monotonic() < deadline:
                time.sleep(0.5)
        left = self.leftovers()
        if not left:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            (self.root / STATE_FILE).unlink(missing_ok=True)
            self.state = {}
        return left

    def status(self) -> dict:
        return {"gcs_address": self.state.get("gcs_address"), "dashboard_url": self.state.get("dashboard_url"),
                "nodes": {n: {"pid": self.root_pid(n), "running": self.is_running(n),
                              "cpus": self.state["nodes"][n]["cpus"]} for n in self.node_names()},
                "registered": self.alive_nodes() if self.state else {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.local_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--root", type=Path, default=LocalClusterConfig.root, help="directory of cluster.json and logs")
    p.add_argument("--head-cpus", type=int, default=1, help="--num-cpus of the head")
    p.add_argument("--worker-cpus", type=int, nargs="*", default=[1], help="--num-cpus of each worker node")
    args = p.parse_args(argv)
    try:
        cluster = LocalCluster(LocalClusterConfig(root=args.root, head_cpus=args.head_cpus,
                                                  worker_cpus=tuple(args.worker_cpus)))
        if args.action == "start":
            cluster.start()
            print(json.dumps(cluster.status(), indent=2))
            print(f"RAY_ADDRESS={cluster.gcs_address}  (ray job submit --address {cluster.dashboard_url})")
        elif args.action == "stop":
            left = cluster.stop()
            if left:
                print(f"still running: {left}", file=sys.stderr)
                return 1
            print("stopped")
        else:
            print(json.dumps(cluster.status(), indent=2))
    except (ValueError, RuntimeError) as exc:
        print(f"cluster-local: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
