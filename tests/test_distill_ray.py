"""distill-data over Ray replicas: the shards equal the in-process run's, and a replica killed
through its handle mid-run loses only its unfinished shard (a re-run answers the rest)."""

from __future__ import annotations

import time

import pytest

from adaptation.distill import DistillConfig, EngineGenerator, distill, plan_from_sharegpt, read_distilled, shard_path
from speculation import assets
from tests.ray_fixtures import ray_local  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

CFG = DistillConfig(max_new_tokens=8, max_turns=1, shard_size=1, greedy_fraction=0.5)
META = {"target": "smollm2-135m", "dtype": "float32", "generator": "engine", "heldout": 24, "sharegpt": "packaged"}


def test_replicas_write_the_in_process_shards_and_survive_a_killed_replica(tmp_path, smol_fp32, ray_local):  # noqa: F811
    from cluster.distill_fanout import DistillReplica, distill_on_ray

    ray = ray_local
    plan = plan_from_sharegpt(str(assets.sharegpt_path()), 24, 4)
    solo = tmp_path / "solo"
    distill(plan, solo, CFG, smol_fp32.tokenizer, EngineGenerator(smol_fp32, 2, 1100), smol_fp32.eos_token_ids,
            META, progress=False)
    fanned = tmp_path / "fanned"
    victim = DistillReplica.options(num_cpus=1).remote("smollm2-135m", "float32", "engine", 2, CFG, 1)
    ray.get(victim.pid.remote())  # loaded
    from adaptation.distill import open_directory

    open_directory(plan, fanned, CFG, META)
    pending = victim.run.remote(plan, str(fanned), META, [0, 1, 2, 3])
    deadline = time.monotonic() + 600
    while not shard_path(fanned, 0).is_file():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pending)
    written = sum(shard_path(fanned, s).is_file() for s in range(4))
    assert 1 <= written < 4, f"the kill landed after {written} of 4 shards"
    stats = distill_on_ray(plan, fanned, CFG, META, replicas=2, model="smollm2-135m", dtype="float32",
                           backend="engine", batch_size=2, threads=1)
    assert stats.shards_done == 4 and stats.items == 4
    assert list(read_distilled(fanned)) == list(read_distilled(solo))
