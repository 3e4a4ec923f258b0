"""`raytpu data prepare` and the jobs' batch decoders, without Ray: schema, ids,
idempotence, half-written output, and decode == the torch Dataset's items."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from raytpu import cli
from raytpu.config import ConfigError, load_config
from raytpu.driver import preflight
from raytpu.driver.ray_trainer import materialize_train
from raytpu.job import load_job, table_for
from raytpu.storage import tables as ingest

MSHNET = ("mshnet", "jobs/mshnet/small.yaml", {"n": 20, "size": 48, "seed": 0})
CDEIT = ("cdeit", "jobs/cdeit/small.yaml", {"n_train": 6, "n_valid": 3, "n_test": 3, "size": 32, "seed": 0})


@pytest.fixture(scope="module", params=[MSHNET, CDEIT], ids=["mshnet", "cdeit"])
def native(request, tmp_path_factory):
    name, config, options = request.param
    job = load_job(name)
    src = tmp_path_factory.mktemp(name) / "native"
    job.synthesize(src, **options)
    return job, config, src


def test_prepare_writes_one_table_per_split_with_ids_and_stats(native, tmp_path):
    job, _, src = native
    manifest = ingest.prepare(job, src, str(tmp_path / "pq"), rows_per_file=4)
    assert set(manifest["tables"]) == set(job.table_names(src)) and manifest["tables"]
    for info in manifest["tables"].values():
        read = pq.read_table([str(tmp_path / "pq" / f) for f in info["files"]])
        assert read.column("id").to_pylist() == list(range(info["rows"]))
        assert all(pq.read_metadata(tmp_path / "pq" / f).num_rows <= 4 for f in info["files"])
        assert info["schema"]["id"] == "int64"
        assert info["bytes"] == pytest.approx(read.nbytes, rel=0.1)  # in memory, as Ray holds it
    schema = manifest["tables"]["train"]["schema"]
    if job.name == "mshnet":
        assert schema["image"] == schema["mask"] == "binary"
    else:
        assert schema["xs"] == "fixed_size_list<item: float>[1024]"
        assert manifest["tables"]["train"]["shapes"]["ys"] == [208, 1]
    for name in getattr(job, "stats_files", ()):
        assert (tmp_path / "pq" / name).read_bytes() == (src / name).read_bytes()
    assert not (tmp_path / "pq" / ingest.PARTIAL).exists()


def test_prepare_is_idempotent_and_rewrites_when_options_change(native, tmp_path):
    job, _, src = native
    out = str(tmp_path / "pq")
    first = ingest.prepare(job, src, out, rows_per_file=4)
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "pq").rglob("*")}
    again = ingest.prepare(job, src, out, rows_per_file=4)
    assert again["unchanged"] and again["tables"] == first["tables"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "pq").rglob("*")} == stamps
    bigger = ingest.prepare(job, src, out, rows_per_file=100)
    assert not bigger.get("unchanged")
    assert all(len(info["files"]) == 1 for info in bigger["tables"].values())
    assert not list((tmp_path / "pq").glob("train/part-00001.parquet"))  # the old files are gone


def test_a_half_written_output_is_never_read_and_is_finished_by_a_rerun(native, tmp_path):
    job, _, src = native
    out = tmp_path / "pq"
    ingest.prepare(job, src, str(out), rows_per_file=4)
    (out / ingest.MANIFEST).unlink()  # as if the writer died before its last file
    (out / ingest.PARTIAL).write_text("")
    with pytest.raises(ConfigError, match=f"half-written; run `raytpu data prepare {job.name} --src"):
        ingest.open_prepared(str(out), job.name)
    ingest.prepare(job, src, str(out), rows_per_file=4)
    assert ingest.open_prepared(str(out), job.name).manifest["tables"]


def test_prepare_refuses_a_folder_it_did_not_write(tmp_path):
    job = load_job("mshnet")
    job.synthesize(tmp_path / "native", n=8, size=32, seed=0)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="not written by `raytpu data prepare`"):
        ingest.prepare(job, tmp_path / "native", str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_decoded_batches_equal_the_torch_dataset_items(native, tmp_path, split):
    job, config, src = native
    uri = (tmp_path / "pq").as_uri()  # file:// through the pyarrow filesystem layer
    ingest.prepare(job, src, uri, rows_per_file=4)
    sizes = ["job.base_size=48", "job.crop_size=32"] if job.name == "mshnet" else []
    cfg, _ = load_config(config, [f"data.path={src}", *sizes])
    prepared = ingest.open_prepared(uri, job.name)
    table = table_for(job, cfg, split)
    info = prepared.table(table)
    rows = pq.read_table(prepared.paths(table), filesystem=prepared.fs).slice(1, 3)
    columns = ingest.to_columns(rows, info["shapes"])
    decoded = job.batch_decoder(cfg, split, prepared.stats_root())(columns, 2)
    dataset = job.build_dataset(cfg, split, src)
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(2)
    for key, value in decoded.items():
        expected = torch.stack([dataset[int(i)][key] for i in columns["id"]])
        assert value.shape == expected.shape and torch.equal(value, expected), key


def test_stats_downloaded_from_a_remote_folder_are_deleted_with_it(tmp_path):
    """A worker reading a bucket's prepared folder downloads its stats files into a local folder,
    which goes with the prepared folder's object (or the process): none is left in /tmp."""
    import gc

    import pyarrow.fs as pafs

    (tmp_path / "bucket").mkdir()
    (tmp_path / "bucket" / "mean.pth").write_bytes(b"stats")
    remote = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())  # not local to raytpu's eyes
    prepared = ingest.Prepared("s3://bucket", remote, "bucket", {"stats": ["mean.pth"], "tables": {}})
    root = prepared.stats_root()
    assert (root / "mean.pth").read_bytes() == b"stats" and root.parent != tmp_path
    del prepared
    gc.collect()
    assert not root.exists()


def test_ray_loader_without_prepared_tables_says_to_prepare(tmp_path):
    cfg, job = load_config("jobs/mshnet/small.yaml", ["data.loader=ray", f"data.path={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"run `raytpu data prepare mshnet --src .* --out {tmp_path}`"):
        preflight.resolve_data_root(cfg, job)


def test_cli_prepare(tmp_path, capsys):
    load_job("mshnet").synthesize(tmp_path / "native", n=8, size=32, seed=0)
    args = ["data", "prepare", "mshnet", "--src", str(tmp_path / "native"), "--out", str(tmp_path / "pq")]
    assert cli.main(args) == 0
    assert "wrote: mshnet parquet tables" in capsys.readouterr().out
    assert cli.main(args) == 0
    assert "already prepared, unchanged" in capsys.readouterr().out
    assert cli.main(["data", "prepare", "mshnet", "--src", str(tmp_path / "none"), "--out", str(tmp_path / "x")]) == 2
    assert Path(tmp_path / "pq" / ingest.MANIFEST).is_file()


def test_only_a_train_set_within_materialize_mb_and_a_quarter_of_the_object_store_is_materialized(
    native, tmp_path, monkeypatch
):
    import ray

    job, config, src = native
    ingest.prepare(job, src, str(tmp_path / "pq"))
    prepared = ingest.open_prepared(str(tmp_path / "pq"), job.name)
    arrow = prepared.table_bytes("train")
    del prepared.manifest["tables"]["train"]["bytes"]  # an older manifest: the files' sizes
    size = prepared.table_bytes("train")
    assert 0 < arrow / 2 <= size <= 2 * arrow
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"object_store_memory": 4.0 * size})
    for limit, materialized in ((0, False), (size / 2**20, True), (size / 2**20 / 2, False)):
        cfg, _ = load_config(config, [f"data.materialize_mb={limit}"])
        assert materialize_train(cfg, prepared, "train") is materialized, limit
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"object_store_memory": 4.0 * size - 1})
    cfg, _ = load_config(config, [])
    assert not materialize_train(cfg, prepared, "train")
