"""Bad input to the converters: one clear error line naming the problem and the fix, no output left behind."""

import json
import shutil

import pytest

from .conftest import script

H2M = "convert/hf_to_megatron.py"
M2H = "convert/megatron_to_hf.py"


def run(capsys, rel, args):
    from megatron_vlm.cli import run_cli

    rc = run_cli(script(rel).main, [str(a) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


@pytest.fixture(scope="module")
def meg(hf_models, tmp_path_factory):
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    return convert_hf_to_megatron(hf_models["llama_clip"], tmp_path_factory.mktemp("m") / "legacy", tp=2,
                                  ckpt_format="torch")


@pytest.mark.parametrize("args,expect", [
    (["--tp", "3"], "tp=3 does not divide num_attention_heads=4 of language model; choose --tp from [1, 2], the sizes "
                    "every part of this model splits over"),  # 2 KV heads: --tp 4 would not split them
    (["--tp", "8"], "tp=8 does not divide num_attention_heads=4"),
    (["--pp", "3"], "pp=3 does not divide num_layers=2 of language model"),
    (["--pp", "2", "--pp-layers", "2,1"], "--pp-layers 2,1 must give 2 positive counts summing to num_layers=2"),
    (["--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2"], "--num-virtual-stages-per-pipeline-rank 2: "
     "pipeline rank 0 holds 1 language layer (--pp 2), which do not split into 2 model chunks of equal size"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "--num-layers-per-virtual-pipeline-stage needs pipeline "
     "parallelism"),
])
def test_bad_parallelism(args, expect, hf_models, tmp_path, capsys):
    out = tmp_path / "out"
    rc, line = run(capsys, H2M, ["--hf-dir", hf_models["llama_clip"], "--megatron-dir", out, *args])
    assert rc == 2 and line.startswith("error: ") and expect in line
    assert not out.exists() and not any(tmp_path.iterdir())


def test_unsupported_architecture(hf_models, tmp_path, capsys):
    bad = tmp_path / "gpt2_llava"
    shutil.copytree(hf_models["llama_clip"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, line = run(capsys, H2M, ["--hf-dir", bad, "--megatron-dir", tmp_path / "out"])
    assert rc == 2 and "'gpt2' is not supported; supported: llama, mistral, qwen2" in line
    assert not (tmp_path / "out").exists()


def test_missing_safetensors(hf_models, tmp_path, capsys):
    bad = tmp_path / "noweights"
    shutil.copytree(hf_models["llama_clip"], bad)
    (bad / "model.safetensors").unlink()
    rc, line = run(capsys, H2M, ["--hf-dir", bad, "--megatron-dir", tmp_path / "out"])
    assert rc == 2 and "has no model.safetensors" in line
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors(hf_models, tmp_path, capsys):
    bad = tmp_path / "truncated"
    shutil.copytree(hf_models["llama_clip"], bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    rc, line = run(capsys, H2M, ["--hf-dir", bad, "--megatron-dir", tmp_path / "out"])
    assert rc == 2 and "is truncated" in line and "re-download" in line
    assert not (tmp_path / "out").exists()


def test_megatron_dir_without_tracker(meg, tmp_path, capsys):
    bad = tmp_path / "notracker"
    shutil.copytree(meg, bad)
    (bad / "latest_checkpointed_iteration.txt").unlink()
    rc, line = run(capsys, M2H, ["--megatron-dir", bad, "--hf-dir", tmp_path / "hf"])
    assert rc == 2 and "has no latest_checkpointed_iteration.txt" in line and "--iteration" in line
    assert not (tmp_path / "hf").exists()


def test_megatron_tp_mismatch(meg, tmp_path, capsys):
    rc, line = run(capsys, M2H, ["--megatron-dir", meg, "--hf-dir", tmp_path / "hf", "--tp", "1"])
    assert rc == 2 and "--tp 1 does not match" in line and "pass --tp 2" in line
    assert not (tmp_path / "hf").exists()


def test_incomplete_legacy_checkpoint(meg, tmp_path, capsys):
    bad = tmp_path / "partial"
    shutil.copytree(meg, bad)
    shutil.rmtree(bad / "release" / "mp_rank_01")
    rc, line = run(capsys, M2H, ["--megatron-dir", bad, "--hf-dir", tmp_path / "hf"])
    assert rc == 2 and "mp_rank_01/model_optim_rng.pt: missing rank file" in line, line
    assert "the checkpoint spans tp=2 pp=1); the checkpoint is incomplete" in line, line  # (its ckpt_meta.json)
    assert not (tmp_path / "hf").exists()


def test_existing_output_needs_overwrite(hf_models, meg, capsys):
    rc, line = run(capsys, H2M, ["--hf-dir", hf_models["llama_clip"], "--megatron-dir", meg])
    assert rc == 2 and "already exists; remove it or pass --overwrite" in line


# ---- moved from tests/test_bad_inputs.py (one lane): these run megatron-core's code, so both lanes run them ------
def _full_text(capsys, rel, args):
    from megatron_vlm.cli import run_cli

    rc = run_cli(script(rel).main, [str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _clean_failure(rc, text, expect, absent):
    assert rc == 2 and "Traceback" not in text, text
    for word in expect:
        assert word in text, f"{word!r} not in:\n{text}"
    assert not absent.exists() and not list(absent.parent.glob(f".{absent.name}.*")), absent


def test_an_output_under_a_file_is_named(hf_models, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    rc, text = _full_text(capsys, H2M, ["--hf-dir", hf_models["llama_clip"], "--megatron-dir", a_file / "meg"])
    _clean_failure(rc, text, ["a_file", "not a directory"], a_file.parent / "meg")


# faults the environment causes (simulated where root cannot cause them: CI runs as root)
@pytest.mark.parametrize("fault,expect", [
    ("enospc", ["no space left on the device", "free space"]),
    ("eacces", ["permission denied", "choose a directory you can write"]),
])
def test_filesystem_faults(fault, expect, meg, tmp_path, capsys, monkeypatch):
    import errno
    import os

    import megatron_vlm.files.atomic
    from megatron_vlm.convert import hf_io

    def full_disk(fd, data, offset):  # the safetensors writer's write of a tensor's bytes
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def read_only(prefix=None, dir=None, **kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))

    if fault == "eacces":
        monkeypatch.setattr(megatron_vlm.files.atomic.tempfile, "mkdtemp", read_only)
    else:
        monkeypatch.setattr(hf_io, "write_all", full_disk)
    args = ["--megatron-dir", meg, "--hf-dir", tmp_path / "hf"]
    rc, text = _full_text(capsys, M2H, args)
    _clean_failure(rc, text, expect, tmp_path / "hf")
    if fault == "eacces":
        assert f"{tmp_path}: permission denied" in text
    # -v shows the traceback (and still ends with the one line)
    rc, text = _full_text(capsys, M2H, [*args, "-v"])
    assert rc == 2 and "Traceback" in text and text.strip().splitlines()[-1].startswith("error: ")
