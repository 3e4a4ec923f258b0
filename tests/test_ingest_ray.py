"""data.loader=ray on the session's Ray: through real Ray Train (2 local CPU workers) the two
ingest paths visit the same samples; a run resumes from a mid-epoch checkpoint. (MSHNet tested
and CDEIT trained through Ray Data on Ray Train: tests/test_integration_ray.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from raytpu.config import load_config
from raytpu.driver.ray_trainer import read_datasets
from raytpu.records import checkpoints as ckpt
from raytpu.storage import tables as ingest

pytestmark = pytest.mark.integration

WORKERS, EPOCHS, SAMPLES, BATCH = 2, 2, 70, 4  # 35 rows a worker: 8 batches, 3 rows dropped


def record_ids(payload: dict[str, Any]) -> None:
    """A Ray Train worker: both ingest paths' batches for two epochs, written as JSON."""
    import ray.train

    from raytpu.config import from_dict
    from raytpu.runtime import make_runtime
    from raytpu.worker.data import make_worker_data

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    datasets = {name: ray.train.get_dataset_shard(name) for name in ("train", "valid")}
    record: dict[str, Any] = {}
    for loader in ("torch", "ray"):
        cfg, job = from_dict({**payload["config"], "data": {**payload["config"]["data"], "loader": loader}})
        runtime = make_runtime("cpu", "fp32", world, rank, 0)
        run_dir = Path(payload["run_dir"])
        data = make_worker_data(cfg, job, runtime, run_dir, datasets)
        per_epoch = data.batches_per_epoch()
        epochs = []
        for epoch in range(EPOCHS):
            batches = list(data.epoch(epoch, 0))
            ids, shapes = [b["index"].tolist() for b in batches], [list(b["x"].shape) for b in batches]
            epochs.append({"ids": ids, "shapes": shapes})
        record[loader] = {"per_epoch": per_epoch, "epochs": epochs}
    (run_dir / f"rank_{rank}.json").write_text(json.dumps(record))


def toy_config(tmp_path: Path) -> tuple[Any, Any]:
    cfg, job = load_config(
        None,
        [
            "job.name=tests.toy_job",
            f"job.samples={SAMPLES}",
            f"data.path={tmp_path / 'pq'}",
            "data.loader=ray",
            f"data.global_batch_size={WORKERS * BATCH}",
            f"scaling.num_workers={WORKERS}",
        ],
    )
    job.synthesize(tmp_path / "native", samples=SAMPLES)
    ingest.prepare(job, tmp_path / "native", str(tmp_path / "pq"), rows_per_file=16)
    import ray

    from raytpu.config import with_values
    from raytpu.config.plan import leave_cpu_for_ray_data
    from raytpu.runtime.placement import ClusterOffer

    cluster = ClusterOffer(nodes=({"CPU": ray.cluster_resources()["CPU"]},))
    return with_values(cfg, leave_cpu_for_ray_data(cfg, cluster)), job


def test_both_paths_give_every_worker_the_same_steps_and_each_id_once_per_epoch(ray_session, tmp_path):
    from ray.train import DataConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytpu.config import to_dict

    cfg, job = toy_config(tmp_path)
    trainer = TorchTrainer(
        record_ids,
        train_loop_config={"config": to_dict(cfg), "run_dir": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": cfg.scaling.cpus_per_worker}),
        run_config=RunConfig(name="equivalence", storage_path=str(tmp_path / "results")),
        datasets=read_datasets(cfg, job, "train"),
        dataset_config=DataConfig(datasets_to_split=["train"]),
    )
    trainer.fit()
    records = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in range(WORKERS)]
    expected = (SAMPLES // WORKERS) // BATCH
    for loader in ("torch", "ray"):
        for epoch in range(EPOCHS):
            seen: list[int] = []
            for record in records:
                assert record[loader]["per_epoch"] == expected, loader
                batches = record[loader]["epochs"][epoch]
                assert len(batches["ids"]) == expected, (loader, epoch)
                assert all(shape == [BATCH, 8] for shape in batches["shapes"]), (loader, batches["shapes"])
                seen += [i for batch in batches["ids"] for i in batch]
            assert len(seen) == len(set(seen)) == WORKERS * expected * BATCH, (loader, epoch)
            assert set(seen) <= set(range(SAMPLES)), loader
        for record in records:  # a global reshuffle each epoch: a worker's samples change, not only their order
            first, second = ({i for batch in e["ids"] for i in batch} for e in record[loader]["epochs"])
            assert first != second, loader


def test_resume_from_a_mid_epoch_checkpoint_restarts_that_epoch_pass(ray_session, tmp_path):
    """In-process, one worker: the failure at step 13 leaves the step-10 checkpoint (epoch 1,
    2 of 8 steps done); the resumed run draws a fresh pass of epoch 1, drops its first 2
    batches, and ends like an uninterrupted run: step 24, epoch 3, 8 steps an epoch."""
    from raytpu.runtime import make_runtime
    from raytpu.worker.loop import Trainer
    from raytpu.worker.reporting import FolderReporter

    cfg, job = load_config(None, ["job.name=tests.toy_job", f"data.path={tmp_path / 'pq'}", "data.loader=ray"])
    job.synthesize(tmp_path / "native")
    ingest.prepare(job, tmp_path / "native", str(tmp_path / "pq"), rows_per_file=16)
    common = ["loop.epochs=3", "checkpoint.every_steps=5", "logging.progress_bar=false"]

    def run(*extra: str) -> Trainer:
        cfg, job = load_config(
            None, ["job.name=tests.toy_job", f"data.path={tmp_path / 'pq'}", "data.loader=ray", *common, *extra]
        )
        datasets = {k: v.iterator() for k, v in read_datasets(cfg, job, "train").items()}
        runtime = make_runtime("cpu", "fp32", 1, 0, 0)
        trainer = Trainer(cfg, job, runtime, tmp_path / "run", tmp_path, FolderReporter(tmp_path / "run"), datasets)
        trainer.fit()
        return trainer

    with pytest.raises(RuntimeError, match="fault injected"):
        run("job.fail_at_step=13")
    assert ckpt.read_meta(FolderReporter(tmp_path / "run").latest_checkpoint())["step"] == 10
    resumed = run()
    assert (resumed.progress.step, resumed.progress.epoch, resumed.steps_per_epoch) == (24, 3, 8)
