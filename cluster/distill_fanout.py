"""``graftblock distill-data --replicas N``: the plan's shards fanned out over N target replicas.

Each :class:`DistillReplica` actor loads its own copy of the target and answers the shards
``i, i + N, i + 2N, ...`` of the plan into the shared output directory, exactly as the in-process
run would (same shard contents: a shard is answered by one replica with the same batches and
seeds). Shards are written atomically and carry their own counters, so a replica lost mid-run
(a node failure, ``ray.kill``) loses only the shard it was writing: re-running the command
answers the missing shards and nothing twice. The output directory must be visible to every
replica (one machine, or a shared file system on a cluster).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import ray
import torch

from adaptation.distill import (
    DistillConfig,
    DistillItem,
    DistillStats,
    distill,
    make_generator,
    open_directory,
    shard_path,
    write_manifest,
)
from speculation import assets
from speculation.config import DType
from speculation.model.target import TargetModel


@ray.remote
class DistillReplica:
    """One target replica answering the shards it is given."""

    def __init__(self, model: str, dtype: str, backend: str, batch_size: int, cfg: DistillConfig,
                 threads: int | None) -> None:
        if threads:
            torch.set_num_threads(threads)
        weights, tokenizer = assets.load_model_and_tokenizer(model, DType.parse(dtype).torch)
        self.target = TargetModel(weights, tokenizer)
        self.cfg = cfg
        self.generator = make_generator(backend, self.target, batch_size, cfg)

    def pid(self) -> int:
        return os.getpid()

    def run(self, plan: list[DistillItem], out: str, meta: dict, shards: list[int]) -> dict:
        stats = distill(plan, out, self.cfg, self.target.tokenizer, self.generator, self.target.eos_token_ids,
                        meta, progress=False, shards=shards)
        return asdict(stats)


def distill_on_ray(plan: list[DistillItem], out: str | Path, cfg: DistillConfig, meta: dict, replicas: int,
                   model: str, dtype: str, backend: str, batch_size: int, threads: int | None = None,
                   num_cpus: float = 1.0) -> DistillStats:
    """Answer ``plan`` into ``out`` over ``replicas`` actors (Ray must be initialised); returns the
    directory's counters. Only shards missing from ``out`` are assigned (a resumed run)."""
    if replicas < 1:
        raise ValueError(f"distill: replicas must be >= 1, got {replicas}")
    root = Path(out)
    contract, n_shards = open_directory(plan, root, cfg, meta)  # before any replica: one manifest
    todo = [s for s in range(n_shards) if not shard_path(root, s).is_file()]
    if todo:
        parts = [todo[i::replicas] for i in range(min(replicas, len(todo)))]
        actors = [DistillReplica.options(num_cpus=num_cpus).remote(model, dtype, backend, batch_size, cfg, threads)
                  for _ in parts]
        try:
            ray.get([a.run.remote(plan, str(root), meta, part) for a, part in zip(actors, parts)])
        finally:
            for a in actors:
                ray.kill(a)
    return write_manifest(root, contract, n_shards)
