"""Online training against an object store: moto's S3 server on loopback is the bucket, a multi-storage-client
profile points at it. The dataset is written and `energon prepare`d in the bucket, training reads it from
there, checkpoints are saved to and resumed from the bucket (TP=2, two CPU processes), and an interrupted
save (iteration directory without its commit) is ignored and cleaned up."""

import json
import logging
import sys

import pytest

from megatron_vlm.files import storage
from megatron_vlm.runtime import mcore_version
from megatron_vlm.launch import preflight
from megatron_vlm.launch.container import mounts
from megatron_vlm.launch.torchrun import free_port
from tests.support import forked_cli
from megatron_vlm.training.config import ConfigError, TrainConfig

from .conftest import ROOT
from .launch_helpers import base_args
from .train_helpers import args, losses, run, setup  # noqa: F401  (setup is the module fixture reused here)

BUCKET, PROFILE = "vlm-bucket", "s3test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 endpoint (moto server mode) with one bucket, and MSC_CONFIG naming a profile for it."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    keys = dict(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    client = boto3.client("s3", endpoint_url=endpoint, **keys)
    client.create_bucket(Bucket=BUCKET)
    config = tmp_path_factory.mktemp("msc") / "msc_config.json"
    config.write_text(json.dumps({"profiles": {PROFILE: {
        "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": endpoint,
                                                        "region_name": "us-east-1"}},
        "credentials_provider": {"type": "S3Credentials", "options": {"access_key": "testing",
                                                                      "secret_key": "testing"}},
    }}}))
    mp = pytest.MonkeyPatch()
    mp.setenv("MSC_CONFIG", str(config))  # inherited by the launcher, torchrun, the ranks and their workers
    yield {"client": client, "url": f"msc://{PROFILE}", "config": config}
    mp.undo()
    server.stop()


def keys(s3, prefix):
    pages = s3["client"].get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def read(s3, key):
    return s3["client"].get_object(Bucket=BUCKET, Key=key)["Body"].read()


def test_remote_paths_fail_with_the_fix_named(s3, tmp_path, monkeypatch):
    with pytest.raises(storage.RemoteStorageError, match="profile 'nope' is not defined in the MSC config"):
        storage.check_url("msc://nope/data", "--data-path")
    with pytest.raises(storage.RemoteStorageError, match="s3:// scheme is not supported.*msc://PROFILE/PATH"):
        storage.check_url("s3://bucket/data", "--data-path")
    assert preflight.check_data(f"{s3['url']}/missing") == [
        f"--data-path {s3['url']}/missing is not a prepared energon dataset (no .nv-meta/dataset.yaml there); "
        f"write it with data_prep/make_wds.py --output {s3['url']}/missing"]
    # the resolved config: checkpoints in the bucket, config and logs on local disk; containers get the profiles
    cfg = TrainConfig.from_args([*base_args(tmp_path), "--data-path", f"{s3['url']}/data", "--save-dir",
                                 f"{s3['url']}/runs/", "--name", "r1"])
    assert cfg.checkpoint_dir == f"{s3['url']}/runs/r1" and cfg.log_dir == str(tmp_path.cwd() / "outputs" / "r1")
    assert list(cfg.resolution_notes) == [f"--save-dir is remote: checkpoints go to {s3['url']}/runs/r1, config "
                                          f"and logs to {cfg.log_dir} (set --log-dir to change)"]
    assert str(s3["config"]) in [m.src for m in mounts(cfg, str(ROOT))]
    with pytest.raises(ConfigError, match="--log-dir msc://s3test/logs: must be a local path"):
        TrainConfig.from_args([*base_args(tmp_path), "--save-dir", f"{s3['url']}/runs", "--log-dir",
                               f"{s3['url']}/logs"])

    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "absent.yaml"))
    with pytest.raises(storage.RemoteStorageError, match=r"MSC_CONFIG=.*absent.yaml does not exist"):
        storage.check_url(f"{s3['url']}/data", "--save-dir")
    monkeypatch.delenv("MSC_CONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(storage.RemoteStorageError, match="no MSC config"):
        storage.check_url(f"{s3['url']}/data", "--save-dir")


@pytest.mark.slow
def test_dataset_prepared_in_bucket_train_save_and_resume_there(s3, setup, tmp_path):
    data = f"{s3['url']}/datasets/squares"
    out = forked_cli.run([sys.executable, "data_prep/make_wds.py", "--format", "vqa", "--input",
                          str(setup["root"] / "qa.jsonl"), "--image-root", str(setup["root"] / "img"),
                          "--output", data, "--shard-size", "24", "--no-progress"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    objects = keys(s3, "datasets/squares/")
    tars = sorted(p.name for p in setup["data"].glob("*.tar"))  # the same input made on local disk
    assert len(tars) == 5 and [k for k in objects if k.endswith(".tar")] == [f"datasets/squares/{t}" for t in tars]
    assert {"datasets/squares/.nv-meta/dataset.yaml", "datasets/squares/.nv-meta/split.yaml",
            "datasets/squares/.nv-meta/index.sqlite"} <= set(objects)  # written by energon prepare in the bucket
    assert json.loads(read(s3, "datasets/squares/make_wds.json"))["output"] == data
    again = forked_cli.run([sys.executable, "data_prep/make_wds.py", "--format", "vqa", "--input",
                            str(setup["root"] / "qa.jsonl"), "--output", data, "--no-progress"],
                           cwd=ROOT, capture_output=True, text=True)  # a non-empty bucket prefix is not overwritten
    assert again.returncode != 0 and "already holds objects; remove them or pass --overwrite" in again.stderr
    assert "Traceback" not in again.stderr and keys(s3, "datasets/squares/") == objects
    for name in (*tars, ".nv-meta/split.yaml"):  # the same bytes as prepared on local disk
        assert read(s3, f"datasets/squares/{name}") == (setup["data"] / name).read_bytes()

    save = f"{s3['url']}/runs"
    common = ("--tp", "2", "--stage", "2", "--global-batch-size", "8", "--save-interval", "4", "--deterministic",
              "--data-path", data, "--save-dir", save, "--log-dir", str(tmp_path / "logs"))
    out = run(args(setup, "remote", *common, iters=8))
    assert f"checkpoints go to {save}/remote" not in out  # --log-dir given: no note about the default
    first = losses(tmp_path / "logs")
    assert sorted(first) == list(range(1, 9))
    ckpt = keys(s3, "runs/remote/")
    assert read(s3, "runs/remote/latest_checkpointed_iteration.txt") == b"8"
    for it in (4, 8):
        d = f"runs/remote/iter_{it:07d}/"
        files = {"ckpt_meta.json", "vlm_spec.json", "hf_extra.safetensors", "config.yaml", "metadata.json", ".metadata"}
        if mcore_version.writes_common_file():  # megatron-core 0.16; 0.17+ keep common state in the .distcp files
            files.add(mcore_version.COMMON_FILE)
        assert {d + n for n in files} <= set(ckpt)
        assert sum(k.startswith(d) and k.endswith(".distcp") for k in ckpt) >= 2  # the two TP ranks' shards
    assert "runs/remote/tokenizer/tokenizer.json" in ckpt and "runs/remote/vlm_spec.json" in ckpt
    assert not (tmp_path / "logs" / "iter_0000004").exists()  # nothing of the checkpoint on local disk

    # A crash while saving iteration 8: the tracker (the commit) still says 4 and iter_0000008 lacks its
    # ckpt_meta.json. Re-running the same command resumes from 4, redoes 5..8 exactly, and cleans up.
    s3["client"].put_object(Bucket=BUCKET, Key="runs/remote/latest_checkpointed_iteration.txt", Body=b"4")
    s3["client"].delete_object(Bucket=BUCKET, Key="runs/remote/iter_0000008/ckpt_meta.json")
    s3["client"].put_object(Bucket=BUCKET, Key="runs/remote/iter_0000008/stale.bin", Body=b"x")
    out = run(args(setup, "remote", *common, iters=8))
    assert "resumed from msc://s3test/runs/remote/iter_0000004 at iteration 4" in out, out[-3000:]
    second = losses(tmp_path / "logs")
    assert [second[i]["loss"] for i in range(5, 9)] == [first[i]["loss"] for i in range(5, 9)]
    assert read(s3, "runs/remote/latest_checkpointed_iteration.txt") == b"8"
    after = keys(s3, "runs/remote/iter_0000008/")
    assert "runs/remote/iter_0000008/ckpt_meta.json" in after and "runs/remote/iter_0000008/stale.bin" not in after
