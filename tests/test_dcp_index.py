"""megatron_vlm.checkpoint.dcp_index reads a torch_dist ``.metadata`` index without torch and without running code: the
same shard byte ranges and tensor shapes as torch's own reader, on converted checkpoints (three families, fp32
and bf16) and on both lanes' training checkpoints (model, optimizer state, scheduler, RNG); anything else in the
pickle is refused."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import megatron.core  # noqa: F401 - its first import runs git (megatron-core 0.19's package_info): at collection
import pytest
from torch.distributed.checkpoint import FileSystemReader

from megatron_vlm.checkpoint.dcp_index import UnreadableIndex, read_index

from .conftest import FAMILIES, ROOT

FIXTURES = Path(__file__).parent / "fixtures"


def torch_facts(it_dir) -> tuple[dict, dict]:
    meta = FileSystemReader(str(it_dir)).read_metadata()
    shards: dict[str, int] = {}
    for info in meta.storage_data.values():
        shards[info.relative_path] = max(shards.get(info.relative_path, 0), info.offset + info.length)
    shapes = {k: tuple(md.size) for k, md in meta.state_dict_metadata.items() if hasattr(md, "size")}
    return shards, shapes


@pytest.fixture(scope="module")
def iteration_dirs(hf_models, tmp_path_factory):
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("dcp_index")
    dirs = [FIXTURES / name / "run" / "iter_0000001" for name in ("mcore-0.16", "mcore-0.19")]
    for name in FAMILIES:
        dirs.append(convert_hf_to_megatron(hf_models[name], root / name) / "release")
    dirs.append(convert_hf_to_megatron(hf_models["llama_clip"], root / "bf16", dtype="bf16") / "release")
    return dirs


def test_the_same_facts_as_torch_reads(iteration_dirs):
    for it_dir in iteration_dirs:
        index = read_index(it_dir)
        shards, shapes = torch_facts(it_dir)
        assert index.shard_bytes == shards and index.shapes == shapes, it_dir
        assert index.shapes and all(isinstance(n, int) for shape in index.shapes.values() for n in shape)
    llama_clip, bf16 = iteration_dirs[2 + list(FAMILIES).index("llama_clip")], iteration_dirs[-1]
    assert read_index(bf16).shapes == read_index(llama_clip).shapes  # the same model, another dtype
    assert read_index(bf16).shard_bytes != read_index(llama_clip).shard_bytes


def test_an_index_naming_other_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Hostile()))
    with pytest.raises(UnreadableIndex, match="names pathlib.Path.touch, which a torch_dist index does not hold"):
        read_index(tmp_path)
    assert not marker.exists()
    pickle.loads((tmp_path / ".metadata").read_bytes())  # the control: pickle itself runs it
    assert marker.exists()


@pytest.mark.parametrize("data", [b"", b"\x80\x04garbage", pickle.dumps({"not": "metadata"})])
def test_a_damaged_index_is_unreadable(data, tmp_path):
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(UnreadableIndex):
        read_index(tmp_path)


@pytest.mark.slow
def test_the_launcher_checks_a_checkpoint_without_importing_torch(iteration_dirs, tmp_path):
    """A CPU launch's launcher reads the index itself (no torch: ~3.5 s of CPU less per launch)."""
    ckpt = iteration_dirs[-1].parent  # llama_clip, converted
    code = ("import sys; from megatron_vlm.checkpoint.checks import check_checkpoint; "
            "from megatron_vlm.launch.preflight import check_spec_against_tensors; from megatron_vlm.model.spec import "
            f"VLMSpec; it = check_checkpoint({str(ckpt)!r}); "
            "assert check_spec_against_tensors(VLMSpec.load(it), 'spec', it) == []; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
