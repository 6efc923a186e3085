"""Checkpoints across the two megatron-core lanes (0.16 on Python 3.11, 0.19 on Python 3.12).

``tests/fixtures/mcore-0.16`` and ``mcore-0.19`` are tiny training checkpoints (saved after step 1) written by
each lane with ``python -m tests.support.cross_version``, with the loss and grad norm of steps 2-3 and
the digests of the HF export recorded by the lane that wrote them. Every lane resumes each fixture it can read
and must reproduce those numbers exactly (0.16 -> 0.19 crosses lanes); megatron-core 0.16 cannot read 0.19's
format, and must say so, naming the writer and what to install.

The grad norms are asked for bit for bit on a machine with the writer's CPU kernels (``cpu_capability``); on
another (AVX2 against AVX-512) the fp32 norm's summation order differs, so there they must agree to 1e-6
relative, while the losses and the exported bytes stay exact (see tests/support/cross_version.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_vlm.checkpoint import layout as ckpt
from megatron_vlm.runtime import mcore_version
from tests.support import cross_version

FIXTURES = Path(__file__).parent / "fixtures"
WRITERS = {"mcore-0.16": "0.16.1", "mcore-0.19": "0.19.2"}
READABLE = [n for n, v in WRITERS.items() if not mcore_version.writes_common_file() or mcore_version.writes_common_file(v)]


def expected(name: str) -> dict:
    return json.loads((FIXTURES / name / cross_version.EXPECTED).read_text())


def test_fixtures_record_the_megatron_core_that_wrote_them():
    for name, version in WRITERS.items():
        meta = ckpt.CheckpointMeta.load(FIXTURES / name / "run" / "iter_0000001")
        assert meta.versions["megatron_core"] == version == expected(name)["written_by"]["megatron_core"]
        has_common = (FIXTURES / name / "run" / "iter_0000001" / mcore_version.COMMON_FILE).is_file()
        assert has_common == mcore_version.writes_common_file(version)


def test_lanes_agree_on_numbers():
    """The two lanes trained the same steps from the same weights to the same losses, bit for bit."""
    a, b = expected("mcore-0.16"), expected("mcore-0.19")
    assert a["cpu_capability"] == b["cpu_capability"]  # written on one machine
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert a["hf_export_sha256"] == b["hf_export_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("name", READABLE)
def test_resume_and_export_match_the_writing_lane_exactly(name, tmp_path):
    run = FIXTURES / name / "run"
    want = expected(name)
    got = cross_version.resume(run)
    assert got["loss"] == want["loss"]
    if cross_version.same_kernels(want):
        assert got["grad_norm"] == want["grad_norm"]
    else:  # the same gradients, reduced in another order (module docstring): the last bits may differ
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6, abs=0)
    assert cross_version.exported_digests(run, tmp_path) == want["hf_export_sha256"]


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_format_this_megatron_core_cannot_read_is_refused_with_what_to_install(name, tmp_path):
    from megatron.core import dist_checkpointing

    run = FIXTURES / name / "run"
    it = run / "iter_0000001"
    if name in READABLE:  # no false alarm: megatron-core reads it, and the check lets it through
        assert "iteration" in dist_checkpointing.load_common_state_dict(str(it))
        assert ckpt.resolve_iteration_dir(run) == it
        return
    # megatron-core itself cannot read it (so the check below guards a real incompatibility)
    with pytest.raises(Exception, match="common.pt"):
        dist_checkpointing.load_common_state_dict(str(it))
    for attempt in (lambda: ckpt.resolve_iteration_dir(run),
                    lambda: ckpt.dist_key_layout(it),
                    lambda: cross_version.exported_digests(run, tmp_path)):
        with pytest.raises(mcore_version.CheckpointVersionError) as e:
            attempt()
        msg = str(e.value)
        assert f"written by megatron-core {WRITERS[name]}" in msg and mcore_version.installed() in msg
        assert "Python 3.12" in msg and "megatron-core>=0.19.2,<0.20" in msg
    assert not (tmp_path / "hf_export").exists()
    # without the recorded version, the format alone still explains it
    copy = tmp_path / "copy"
    shutil.copytree(it, copy)
    meta = json.loads((copy / ckpt.META).read_text())
    meta.pop("versions")
    (copy / ckpt.META).write_text(json.dumps(meta))
    with pytest.raises(mcore_version.CheckpointVersionError, match="megatron-core 0.17 or newer"):
        ckpt.resolve_iteration_dir(copy)


def test_lane_requirements_match_setup_cfg():
    text = (Path(__file__).parents[1] / "setup.cfg").read_text()
    for since, req in mcore_version.LANES:
        marker = f'python_version>="{since[0]}.{since[1]}"' if since >= (3, 12) else 'python_version<"3.12"'
        assert f"{req}; {marker}" in text
    assert mcore_version.lane_requirement((3, 11)) == "megatron-core>=0.16,<0.17"
    assert mcore_version.lane_requirement((3, 12)) == "megatron-core>=0.19.2,<0.20"
    from packaging.requirements import Requirement

    assert mcore_version.installed() in Requirement(mcore_version.lane_requirement()).specifier


def test_the_version_module_does_not_import_the_checkpoint_layout():
    """The dependency runs one way: megatron_vlm.checkpoint.layout -> mcore_version (which owns no file of the
    layout)."""
    import ast

    tree = ast.parse(Path(mcore_version.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "megatron_vlm.checkpoint.layout" not in imported
    assert not any(n.id == "META" for n in ast.walk(tree) if isinstance(n, ast.Name))
