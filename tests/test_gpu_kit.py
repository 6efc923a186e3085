"""tools/gpu_kit.py (``make gpu-kit``): which wheels the GPU kit walks to, its layout, its size refusal and its
atomic write. No network: pip's download is replaced by hand-made wheels with the real metadata format; the real
download is what ``make gpu-kit`` runs (bench/GPU.md records its size)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import script

pytestmark = pytest.mark.one_lane(
    "3.12",
    reason="tools/gpu_kit.py on hand-made wheels (pip metadata, the standard library); the kit is made with the "
           "3.12 lane's venv")


def fake_wheel(folder: Path, name: str, version: str, requires: tuple = ()) -> Path:
    """A minimal valid pure-Python wheel of ``name`` (one module ``<name>_probe.py``) whose METADATA lists
    ``requires`` as Requires-Dist lines; pip installs it."""
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n"
                                                                                     for r in requires)
    files = {f"{mod}_probe.py": "OK = True\n", f"{dist}/METADATA": meta,
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{dist}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


@pytest.fixture(scope="module")
def kit():
    return script("tools/gpu_kit.py")


def test_requires_are_read_for_cpython312_linux_without_extras(kit, tmp_path):
    whl = fake_wheel(tmp_path, "pkg", "1.0", ("numpy", "Flask_Cors>=1; python_version >= '3.10'",
                                               "pywin32; sys_platform == 'win32'", "av>=17; extra == 'av-decode'",
                                               "tomli; python_version < '3.11'"))
    assert kit.wheel_requires(whl) == ["numpy", "flask-cors"]


def test_collect_walks_the_closure_at_the_pins_and_skips_what_the_gpu_image_has(kit, tmp_path, monkeypatch):
    index = {  # name -> its Requires-Dist
        "megatron-core": ("torch>=2.6", "numpy", "packaging", "wandb; extra == 'training'"),
        "megatron-energon": ("multi-storage-client>=0.4", "s3fs", "webdataset", "pillow", "torch"),
        "webdataset": ("braceexpand", "numpy", "pyyaml"),
        "multi-storage-client": ("opentelemetry-api", "python-dateutil"),
        "s3fs": ("botocore",), "botocore": ("jmespath", "urllib3"), "braceexpand": (), "opentelemetry-api": (),
        "jmespath": (),
    }
    asked = []

    def download(specs, dest, log):
        asked.append(specs)
        for spec in specs:
            name, version = spec.split("==")
            fake_wheel(dest, name, version, index[name])

    monkeypatch.setattr(kit, "pip_download", download)
    pins = {n: f"{i}.0" for i, n in enumerate(index, 1)}
    got = kit.collect_wheels(pins, tmp_path / "w", print)
    # torch, numpy, pillow, urllib3, dateutil: the image's own; s3fs and botocore (and so jmespath): LEFT_OUT
    assert got == {n: pins[n] for n in sorted(index) if n not in ("s3fs", "botocore", "jmespath")}
    assert asked[0] == ["megatron-core==1.0", "megatron-energon==2.0", "webdataset==3.0"]
    assert not any("s3fs" in spec or "botocore" in spec for specs in asked for spec in specs)
    del pins["braceexpand"]
    with pytest.raises(SystemExit, match="braceexpand is needed on the GPU machine but has no pin"):
        kit.collect_wheels(pins, tmp_path / "w2", print)


def test_a_wheel_needing_another_version_of_an_image_package_is_refused(kit, tmp_path, monkeypatch):
    """The run uses the image's transformers/tokenizers/...: a kit wheel that the image's version does not satisfy
    is named at build time (here, not as an ImportError on the GPU)."""
    needs = {"megatron-core": ("tokenizers<0.24,>=0.23.1", "transformers>=5.0,<6"),
             "megatron-energon": ("transformers>=5.20",), "webdataset": ()}

    def download(specs, dest, log):
        for spec in specs:
            name, version = spec.split("==")
            fake_wheel(dest, name, version, needs[name])

    monkeypatch.setattr(kit, "pip_download", download)
    pins = {"megatron-core": "1", "megatron-energon": "2", "webdataset": "3"}
    with pytest.raises(SystemExit, match=r"megatron_energon needs transformers>=5.20 \(image: 5.17.0\)") as e:
        kit.collect_wheels(pins, tmp_path / "w", print)
    assert "megatron_core" not in str(e.value)  # 0.23.2 and 5.17.0 meet its ranges
    needs["megatron-energon"] = ()
    assert kit.collect_wheels(pins, tmp_path / "w2", print) == pins


@pytest.mark.slow  # git archive / git ls-files run as processes
def test_kit_layout_size_refusal_and_atomic_replace(kit, tmp_path, capsys):
    constraints = tmp_path / "c.txt"
    constraints.write_text("megatron-core==0.19.2\nmegatron-energon==7.4.1  # pinned\nwebdataset==1.0.2\n")

    def collect(pins, dest, log):
        fake_wheel(dest, "megatron-core", pins["megatron-core"])
        return {"megatron-core": pins["megatron-core"]}

    out = tmp_path / "kit"
    man = kit.build(out, constraints, 60, tree_bytes=1 << 20, collect=collect)
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert names == ["KIT.json", "gpu_quick.sh", "project.tar.gz", "wheels/megatron_core-0.19.2-py3-none-any.whl"]
    assert json.loads((out / "KIT.json").read_text()) == man and len(man["commit"]) == 40
    assert man["wheels"] == {"megatron-core": "0.19.2"} and man["tree_mib"] == 1.0
    assert (out / "gpu_quick.sh").read_bytes() == (kit.ROOT / "bench" / "gpu_quick.sh").read_bytes()
    assert "wrote" in capsys.readouterr().out
    # the kit's project (the commit's tracked files) runs the GPU command from itself alone, as gpu_quick.sh starts it
    # there: bench/gpu.py and the step modules it imports (bench/gpu_steps/) are all in the archive
    with tarfile.open(out / "project.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    project = tmp_path / "unpacked" / "megatron-vlm"
    # less what no GPU step reads (ARCHIVE_LEAVES_OUT): the megatron-core fixtures, 4.7 MiB of the archive's 5.5
    assert (project / "tests" / "conftest.py").is_file() and not (project / "tests" / "fixtures").exists()
    res = subprocess.run([sys.executable, "bench/gpu.py", "--help"], cwd=project, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(project)))
    assert res.returncode == 0 and "--only" in res.stdout, res.stderr[-2000:]
    shutil.rmtree(tmp_path / "unpacked")
    # over the limit: one refusal line, the old kit untouched, no temporary folder left
    with pytest.raises(SystemExit, match=r"^gpu_kit: the kit is .* MiB, over --max-mib 0.001"):
        kit.build(out, constraints, 0.001, tree_bytes=0, collect=collect)
    with pytest.raises(SystemExit, match="over the 64 MiB a device command carries"):
        kit.build(out, constraints, 60, tree_bytes=64 << 20, collect=collect)
    assert json.loads((out / "KIT.json").read_text()) == man
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "kit"]
    constraints.write_text("megatron-core==0.19.2\n")
    with pytest.raises(SystemExit, match="pins no megatron-energon"):
        kit.build(out, constraints, 60, tree_bytes=0, collect=collect)


@pytest.mark.slow  # git archive runs as a process
def test_kit_with_transformer_engine_carries_its_wheels_and_their_dependencies(kit, tmp_path, monkeypatch):
    constraints = tmp_path / "c.txt"
    constraints.write_text("megatron-core==0.19.2\nmegatron-energon==7.4.1\nwebdataset==1.0.2\npydantic==2.1\n"
                           "nvdlfw-inspect==0.2\n")
    te = tmp_path / "te"
    fake_wheel(te, "transformer_engine_cu13", "2.20.2", ("pydantic", "packaging"))
    fake_wheel(te, "transformer_engine", "2.20.2")
    with pytest.raises(SystemExit, match="transformer_engine_torch missing or doubled"):
        kit.te_wheels(te)
    fake_wheel(te, "transformer_engine_torch", "2.20.2", ("torch>=2.1", "pydantic", "nvdlfw-inspect",
                                                           "nvidia-cudnn-frontend>=1.29", "transformer_engine_cu13"))

    def download(specs, dest, log):
        for spec in specs:
            name, version = spec.split("==")
            fake_wheel(dest, name, version)

    monkeypatch.setattr(kit, "pip_download", download)
    man = kit.build(tmp_path / "kit", constraints, 60, tree_bytes=0, te_dir=te)
    te_files = sorted(f for f in man["files"] if f.startswith("te/"))
    # the three TE wheels, and what they add that the image lacks (packaging and torch are the image's;
    # nvidia-* never travel: the image's CUDA stack wins)
    assert te_files == ["te/nvdlfw_inspect-0.2-py3-none-any.whl", "te/pydantic-2.1-py3-none-any.whl",
                        "te/transformer_engine-2.20.2-py3-none-any.whl",
                        "te/transformer_engine_cu13-2.20.2-py3-none-any.whl",
                        "te/transformer_engine_torch-2.20.2-py3-none-any.whl"]
    assert man["te"]["transformer-engine-torch"] == "2.20.2" and man["left_out"] == ["botocore", "s3fs"]


def test_check_te_checks_the_files_plans_the_scratch_install_and_refuses_another_torch(kit, tmp_path, monkeypatch):
    """``--check --te DIR``: DIR's wheels checked (one of each, METADATA against the name, one version, cp312, the
    README's SHA-256s); the plan installs them and the kit's te/ dependencies into a scratch venv over the image's
    torch with --ignore-installed; and it is refused in one line in a Python whose torch is not the image's 2.11
    (this lane's: 2.13) or that lacks onnx/onnxscript. The import itself runs on the GPU machine."""
    import hashlib

    te = tmp_path / "te"
    core = fake_wheel(te, "transformer_engine_cu13", "2.20.2")
    fake_wheel(te, "transformer_engine", "2.20.2")
    ext = fake_wheel(te, "transformer_engine_torch", "2.20.2")
    with pytest.raises(SystemExit, match="not built for CPython 3.12"):
        kit.te_files_checked(te)
    ext = ext.rename(te / "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl")
    digest = hashlib.sha256(core.read_bytes()).hexdigest()
    (te / "README.md").write_text(f"| `{core.name}` (1 MB) | `{digest}` | pruned |\n")
    assert kit.te_files_checked(te)[0] == core
    (te / "README.md").write_text(f"| `{core.name}` (1 MB) | `{'0' * 64}` | pruned |\n")
    with pytest.raises(SystemExit, match="does not match the SHA-256 its README.md lists"):
        kit.te_files_checked(te)
    (te / "README.md").unlink()
    shutil.copyfile(fake_wheel(tmp_path / "other", "transformer_engine", "2.21.0"), te / "transformer_engine-2.20.2-"
                    "py3-none-any.whl")  # a renamed file: its METADATA says 2.21.0
    with pytest.raises(SystemExit, match="its METADATA says transformer_engine 2.21.0"):
        kit.te_files_checked(te)
    fake_wheel(te, "transformer_engine", "2.20.2")
    with pytest.raises(SystemExit, match="no wheel of nvdlfw-inspect"):
        kit.te_check_plan(te, tmp_path / "venv")
    kit_dir = tmp_path / "kit"
    dep = fake_wheel(kit_dir / "te", "nvdlfw_inspect", "0.2.2")
    fake_wheel(kit_dir / "te", "transformer_engine", "9.9")  # the kit's own copy: DIR's wins
    venv_cmd, pip_cmd, import_cmd = kit.te_check_plan(te, tmp_path / "venv", kit_dir)
    assert venv_cmd[-3:] == ["--system-site-packages", "--without-pip", str(tmp_path / "venv")]
    assert "--ignore-installed" in pip_cmd and "--no-index" in pip_cmd and "--no-deps" in pip_cmd
    assert sorted(Path(w).name for w in pip_cmd if w.endswith(".whl")) == sorted(
        [dep.name, core.name, "transformer_engine-2.20.2-py3-none-any.whl", ext.name])
    assert import_cmd[:2] == [str(tmp_path / "venv" / "bin" / "python"), "-c"]
    assert "transformer_engine.pytorch as te" in import_cmd[2] and "te.Linear" in import_cmd[2]
    # refusals: another torch (this lane's), another Python, no onnx
    why = kit.te_refusal("2.13.0+cu130", "3.12")
    assert "built for torch 2.11.0 (the GPU image's), this Python has torch 2.13.0+cu130: run it on the GPU" in why
    assert "needs Python 3.12" in kit.te_refusal("2.11.0", "3.11")
    assert "needs onnxscript" in kit.te_refusal("2.11.0+cu130", "3.12", has=lambda m: m == "onnx")
    assert kit.te_refusal("2.11.0+cu130", "3.12", has=lambda m: True) is None
    import importlib.metadata as md

    if md.version("torch").split("+")[0] != "2.11.0":
        with pytest.raises(SystemExit, match=r"^gpu_kit: --check --te: the Transformer Engine torch extension"):
            kit.main(["--check", "--te", str(te), "--out", str(kit_dir)])
    # where it may run, the plan's commands run in order and the first failure is the exit status
    monkeypatch.setattr(kit, "te_refusal", lambda *a, **k: None)
    ran = []
    assert kit.check_te(te, kit_dir, run=lambda cmd: ran.append(cmd) or subprocess.CompletedProcess(
        cmd, 3 if "-c" in cmd else 0)) == 3
    assert [c[1] for c in ran] == ["-m", "-m", "-c"]
