"""Bad input to every command ends in ONE clear line naming the input, a non-zero exit, no traceback and
no output that looks complete (issue 18). Table-driven: each row is (command, arguments, words the message
must contain, output that must not exist). Commands run in-process through their main(); only the two
checks of the torchrun path (a failing rank, Ctrl-C) start processes. Every flag a message suggests must be one
the command's argparse parser defines (or, after another script's name, that script's: issue 42).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_vlm.data.synthetic import write_image, write_jsonl
from tests.support import forked_cli
from tests.data_fixtures import vqa_dataset, vqa_inputs  # noqa: F401

from .conftest import script
from .parser_helpers import ROOT, command_parser, scripts, unknown_flags
from .launch_helpers import REPO, base_args, launcher, no_slurm_env, signal_when_ready  # noqa: F401 (autouse fixture)

# Both lanes: besides the refusals made before any library runs, its ranks refuse faults inside megatron-core's
# checkpoint load and optimizer (fp16 overflow, missing optimizer state), which differ between the lanes (the lane
# guard saw the forked ranks import megatron-core).

CMD = {
    "build": "convert/build_llava.py",
    "h2m": "convert/hf_to_megatron.py",
    "m2h": "convert/megatron_to_hf.py",
    "wds": "data_prep/make_wds.py",
    "stats": "data_prep/stats.py",
}
_MODULES: dict = {}


def run_command(cmd: str, args: list, capsys) -> tuple[int, str]:
    """Exit code and everything printed, from the command's main() run in-process like its __main__."""
    from megatron_vlm.cli import run_cli

    args = [str(a) for a in args]
    try:
        if cmd == "train":
            from megatron_vlm.launch.cli import main as launch_main

            rc = launch_main(args, repo_root=REPO)
        else:
            if cmd not in _MODULES:
                _MODULES[cmd] = script(CMD[cmd])
            rc = run_cli(_MODULES[cmd].main, args)
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out + out.err


def assert_flags_exist(cmd: str, text: str) -> None:
    """The flags the error line names are the command's own (or the script's it names before them)."""
    line = next((ln for ln in reversed(text.strip().splitlines()) if "error" in ln), "")
    # argparse starts its line with the program's name, sys.argv[0]: under pytest-xdist that is "-c"
    line = re.sub(r"^\S+: error: ", "error: ", line)
    unknown = unknown_flags(line, ROOT / ("train/run.py" if cmd == "train" else CMD[cmd]))
    assert not unknown, f"the message names flags its command does not take: {unknown}\n{line}"


def assert_clean_failure(rc, text, expect, absent=()):
    assert rc not in (0, None), text
    assert "Traceback" not in text, text
    for word in expect:
        assert word in text, f"{word!r} not in:\n{text}"
    for path in absent:
        assert not Path(path).exists(), f"{path} was written"
        leftovers = [p.name for p in Path(path).parent.glob(f".{Path(path).name}.*")] if Path(path).parent.exists() \
            else []
        assert not leftovers, leftovers


# ---- shared inputs (built once) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env(hf_models, tmp_path_factory):
    """A tiny HF LLaVA, its torch_dist checkpoint, a make_wds input tree (with a symlink leaving the root)."""
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("bad")
    hf = hf_models["llama_clip"]
    meg = convert_hf_to_megatron(hf, root / "meg", tp=1)
    legacy = convert_hf_to_megatron(hf, root / "legacy", tp=2, ckpt_format="torch")
    images = root / "in" / "images"
    images.mkdir(parents=True)
    for i in range(2):
        write_image(images / f"{i}.jpg", 32, seed=i)
    write_image(root / "in" / "secret.jpg", 32, seed=9)
    os.symlink(root / "in" / "secret.jpg", images / "link.jpg")  # leads outside --image-root
    os.symlink(images / "0.jpg", images / "inside.jpg")  # stays inside: followed
    rows = [{"image": "0.jpg", "question": "q0", "answer": "red"},
            {"image": "inside.jpg", "question": "q", "answer": "a"}]
    write_jsonl(root / "in" / "good.jsonl", rows)
    write_jsonl(root / "in" / "link.jsonl", rows + [{"image": "link.jpg", "question": "q", "answer": "a"}])
    write_jsonl(root / "in" / "huge.jsonl", rows + [{"image": "1.jpg", "question": "q", "answer": "x" * 1_100_000}])
    (root / "in" / "llava.json").write_text(json.dumps([{"id": "1", "image": "0.jpg", "conversations": [
        {"from": "human", "value": "<image>\nwhat colour?"}, {"from": "gpt", "value": "red"}]}]))
    import gzip

    packed = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows * 200))
    (root / "in" / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    bad_cfg = root / "badcfg"
    bad_cfg.mkdir()
    (bad_cfg / "config.json").write_text('{"model_type": "llava", "text_config": {\x01}')
    no_cfg = root / "nocfg"
    no_cfg.mkdir()
    empty = root / "empty"
    empty.mkdir()
    bad_tok = root / "badtok"
    bad_tok.mkdir()
    (bad_tok / "tokenizer_config.json").write_text("{not json")
    a_file = root / "a_file"
    a_file.write_text("x")
    parts = hf.parent / (hf.name + "_parts")
    return dict(root=root, hf=hf, meg=meg, legacy=legacy, text=parts / "text_llama", vision=parts / "vision_clip", images=images,
                bad_cfg=bad_cfg, no_cfg=no_cfg, empty=empty,
                bad_tok=bad_tok, a_file=a_file)


def damaged_checkpoint(env, tmp_path, how: str) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(env["legacy" if how.startswith("legacy") else "meg"], d)
    rel = d / "release"
    shard = sorted(rel.glob("*.distcp"))[0] if not how.startswith("legacy") else None
    rank1 = rel / "mp_rank_01" / "model_optim_rng.pt"
    if how == "legacy_truncated":  # legacy rank files get the same check as torch_dist shards
        rank1.write_bytes(rank1.read_bytes()[:-4096])
    elif how == "legacy_missing_rank":
        rank1.unlink()
    elif how == "manifest_size":  # a checksum manifest (as training saves write): a file of another size
        from megatron_vlm.checkpoint import manifest

        manifest.write(rel, manifest.entries(rel, manifest.files_of(rel)))
        (rel / "vlm_spec.json").write_text((rel / "vlm_spec.json").read_text() + "\n")  # still valid JSON
    elif how == "tracker":
        (d / "latest_checkpointed_iteration.txt").write_text("garbage\n")
    elif how == "delete_shard":
        shard.unlink()
    elif how == "truncate_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "metadata_json":
        (rel / "metadata.json").write_text('{"sharded_backend": "torch_dist\x01"}')
    elif how == "spec_json":
        (rel / "vlm_spec.json").write_text((rel / "vlm_spec.json").read_text()[:40])
    elif how == "extra_truncated":
        extra = rel / "hf_extra.safetensors"
        extra.write_bytes(extra.read_bytes()[:-64])
    elif how == "dcp_index":
        (rel / ".metadata").write_bytes(b"\x80\x04garbage")
    return d


# ---- the table ----------------------------------------------------------------------------------------------
# Each builder gets (env, tmp_path) and returns (arguments, words the output must contain, paths that must not exist).
def _build(extra):
    return lambda e, t: ["--text-model", e["text"], "--vision-model", e["vision"], "--save-dir", t / "llava", *extra]


def _h2m(extra):
    return lambda e, t: ["--hf-dir", e["hf"], "--megatron-dir", t / "meg", *extra]


def _m2h(extra):
    return lambda e, t: ["--megatron-dir", e["meg"], "--hf-dir", t / "hf", *extra]


def _wds(extra, inp="good.jsonl"):
    return lambda e, t: ["--format", "vqa", "--input", e["root"] / "in" / inp, "--image-root", e["images"],
                         "--output", t / "ds", "--no-progress", "--no-prepare", *extra]


def _truncate(f: Path, size: int) -> Path:
    f.write_bytes(f.read_bytes()[:size])
    return f.parent


CASES = {
    # build_llava: numbers checked at parse time, model directories checked before loading
    "build-padding-negative": ("build", _build(["--vocab-size-padding", "-64"]),
                               ["--vocab-size-padding", "-64 must be at least 1"], ["llava"]),
    "build-padding-zero": ("build", _build(["--vocab-size-padding", "0"]), ["--vocab-size-padding"], ["llava"]),
    "build-image-token-empty": ("build", _build(["--image-token", ""]), ["--image-token", "must be a non-empty token"],
                                ["llava"]),
    "build-seed-negative": ("build", _build(["--seed", "-1"]), ["--seed", "must not be negative"], ["llava"]),
    "build-text-missing": ("build", lambda e, t: ["--text-model", t / "nope", "--vision-model", e["vision"],
                                                   "--save-dir", t / "llava"],
                           ["--text-model", "nope: no such directory"], ["llava"]),
    "build-vision-bad-config": ("build", lambda e, t: ["--text-model", e["text"], "--vision-model", e["bad_cfg"],
                                                        "--save-dir", t / "llava"],
                                ["badcfg/config.json: invalid JSON", "line 1 column"], ["llava"]),
    "build-text-no-config": ("build", lambda e, t: ["--text-model", e["no_cfg"], "--vision-model", e["vision"],
                                                     "--save-dir", t / "llava"],
                             ["--text-model", "has no config.json"], ["llava"]),
    "build-save-under-file": ("build", lambda e, t: ["--text-model", e["text"], "--vision-model", e["vision"],
                                                      "--save-dir", e["a_file"] / "llava"],
                              ["a_file", "not a directory"], []),
    # hf_to_megatron
    "h2m-tp-zero": ("h2m", _h2m(["--tp", "0"]), ["--tp", "0 must be at least 1"], ["meg"]),
    "h2m-pp-negative": ("h2m", _h2m(["--pp", "-2"]), ["--pp", "must be at least 1"], ["meg"]),
    "h2m-pp-word": ("h2m", _h2m(["--pp", "two"]), ["--pp", "'two' is not an integer"], ["meg"]),
    "h2m-tolerance-negative": ("h2m", _h2m(["--verify", "--tolerance", "-1"]), ["--tolerance", "must be positive"],
                               ["meg"]),
    "h2m-tolerance-nan": ("h2m", _h2m(["--tolerance", "nan"]), ["--tolerance", "not a finite number"], ["meg"]),
    "h2m-hf-missing": ("h2m", lambda e, t: ["--hf-dir", t / "nope", "--megatron-dir", t / "meg"],
                       ["--hf-dir", "nope: no such directory"], ["meg"]),
    "h2m-bad-config": ("h2m", lambda e, t: ["--hf-dir", e["bad_cfg"], "--megatron-dir", t / "meg"],
                       ["badcfg/config.json: invalid JSON"], ["meg"]),
    # an output under a file: tests/test_convert_errors.py (found while writing, after megatron-core's import)
    # megatron_to_hf
    "m2h-iteration-word": ("m2h", _m2h(["--iteration", "abc"]), ["--iteration", "'abc' is not an iteration"], ["hf"]),
    "m2h-iteration-negative": ("m2h", _m2h(["--iteration", "-5"]), ["--iteration", "must not be negative"], ["hf"]),
    "m2h-iteration-absent": ("m2h", _m2h(["--iteration", "5"]), ["iter_0000005 does not exist", "available: release"],
                             ["hf"]),
    "m2h-shard-size-zero": ("m2h", _m2h(["--max-shard-size-gb", "0"]), ["--max-shard-size-gb", "must be positive"],
                            ["hf"]),
    "m2h-shard-size-tiny": ("m2h", _m2h(["--max-shard-size-gb", "0.001"]), ["--max-shard-size-gb", "below 0.01"],
                            ["hf"]),
    "m2h-tp-zero": ("m2h", _m2h(["--tp", "0"]), ["--tp", "must be at least 1"], ["hf"]),
    "m2h-tokenizer-empty": ("m2h", lambda e, t: ["--megatron-dir", e["meg"], "--hf-dir", t / "hf", "--tokenizer-dir",
                                                  e["empty"]], ["--tokenizer-dir", "holds no tokenizer"], ["hf"]),
    "m2h-tokenizer-missing": ("m2h", _m2h(["--tokenizer-dir", "/nonexistent/tok"]),
                              ["--tokenizer-dir /nonexistent/tok: no such directory"], ["hf"]),
    "m2h-iteration-conflict": ("m2h", lambda e, t: ["--megatron-dir", e["meg"] / "release", "--hf-dir", t / "hf",
                                                     "--iteration", "3"],
                               ["--iteration 3 conflicts with --megatron-dir", "release, which is iteration release",
                                "drop --iteration"], ["hf"]),
    "m2h-tokenizer-corrupt": ("m2h", lambda e, t: ["--megatron-dir", e["meg"], "--hf-dir", t / "hf",
                                                    "--tokenizer-dir", e["bad_tok"]],
                              ["badtok/tokenizer_config.json: invalid JSON"], ["hf"]),
    **{f"m2h-{how}": ("m2h", lambda e, t, how=how: ["--megatron-dir", damaged_checkpoint(e, t, how), "--hf-dir",
                                                    t / "hf"], expect, ["hf"])
       for how, expect in [
           ("tracker", ["latest_checkpointed_iteration.txt reads 'garbage'", "iteration number"]),
           ("delete_shard", [".distcp: missing shard", "re-convert"]),
           ("truncate_shard", [".distcp: truncated", "bytes, the checkpoint index needs"]),
           ("metadata_json", ["release/metadata.json: invalid JSON"]),
           ("spec_json", ["release/vlm_spec.json: invalid JSON"]),
           ("dcp_index", ["release/.metadata: unreadable"]),
           ("extra_truncated", ["release/hf_extra.safetensors: truncated", "its header needs"]),
           ("legacy_truncated", ["release/mp_rank_01/model_optim_rng.pt: truncated", "pick another --iteration"]),
           ("legacy_missing_rank", ["release/mp_rank_01/model_optim_rng.pt: missing rank file", "tp=2 pp=1"]),
           ("manifest_size", ["release/vlm_spec.json: ", "bytes, its checksums.json says", "damaged"]),
       ]},
    # make_wds
    "wds-workers-negative": ("wds", _wds(["--workers", "-3"]), ["--workers", "-3 must be at least 1"], ["ds"]),
    "wds-workers-zero": ("wds", _wds(["--workers", "0"]), ["--workers"], ["ds"]),
    "wds-shard-size-zero": ("wds", _wds(["--shard-size", "0"]), ["--shard-size", "must be at least 1"], ["ds"]),
    "wds-bad-fraction-high": ("wds", _wds(["--max-bad-fraction", "1.5"]), ["--max-bad-fraction", "within [0, 1]"],
                              ["ds"]),
    "wds-max-text-zero": ("wds", _wds(["--max-text-chars", "0"]), ["--max-text-chars", "must be at least 1"], ["ds"]),
    "wds-split-words": ("wds", _wds(["--split", "a,b"]), ["--split 'a,b'", "three non-negative"], ["ds"]),
    "wds-input-dir": ("wds", lambda e, t: _wds([])(e, t) + ["--input", e["empty"]], ["--input", "empty is not a file"],
                      ["ds"]),
    "wds-input-missing": ("wds", _wds([], inp="nope.jsonl"), ["--input", "nope.jsonl does not exist"], ["ds"]),
    "wds-image-root-missing": ("wds", lambda e, t: _wds([])(e, t) + ["--image-root", t / "noimg"],
                               ["--image-root", "noimg is not a directory"], ["ds"]),
    "wds-huge-answer": ("wds", _wds(["--max-bad-fraction", "0"], inp="huge.jsonl"),
                        ["text too long: 1", "--max-bad-fraction"], ["ds"]),
    "wds-symlink-outside": ("wds", _wds(["--max-bad-fraction", "0"], inp="link.jsonl"),
                            ["symlink outside --image-root: 1", "ds.rejected.jsonl"], ["ds"]),
    "wds-output-under-file": ("wds", lambda e, t: _wds([])(e, t) + ["--output", e["a_file"] / "ds"],
                              ["a_file", "not a directory"], []),
    "wds-format-mismatch": ("wds", _wds([], inp="llava.json"),
                            ["--format vqa: the first record of --input", "llava.json[0]) is a LLaVA record (it has "
                             "'conversations'), not a VQA row; use --format llava"], ["ds"]),
    "wds-split-all-zero": ("wds", _wds(["--split", "0,0,0"]),
                           ["--split '0,0,0': all three weights are 0", "e.g. 9,1,0"], ["ds"]),
    "wds-split-nan": ("wds", _wds(["--split", "nan,1,0"]), ["--split 'nan,1,0'", "finite and not negative"], ["ds"]),
    "wds-truncated-gz": ("wds", _wds([], inp="cut.jsonl.gz"),
                         ["--input", "cut.jsonl.gz: the gzip file is truncated or corrupt", "after line",
                          "download or compress it again"], ["ds"]),
    # stats
    "stats-seq-zero": ("stats", lambda e, t: [t / "ds", "--tokenizer", e["hf"], "--seq-length", "0"],
                       ["--seq-length", "must be at least 1"], ["stats.json"]),
    "stats-weights-negative": ("stats", lambda e, t: [t / "ds", "--tokenizer", e["hf"], "--weights", "-1"],
                               ["--weights", "not negative"], ["stats.json"]),
    "stats-weights-zero": ("stats", lambda e, t: [t / "ds", "--tokenizer", e["hf"], "--weights", "0"],
                           ["--weights", "the blend is empty"], ["stats.json"]),
    "stats-weights-count": ("stats", lambda e, t: [t / "ds", "--tokenizer", e["hf"], "--weights", "1,2"],
                            ["--weights has 2 values for 1 datasets"], ["stats.json"]),
    "stats-tokenizer-missing": ("stats", lambda e, t: [t / "ds", "--tokenizer", "/nonexistent"],
                                ["--tokenizer /nonexistent: no such directory"], ["stats.json"]),
    "stats-tokenizer-empty": ("stats", lambda e, t: [t / "ds", "--tokenizer", e["empty"]],
                              ["--tokenizer", "holds no tokenizer"], ["stats.json"]),
    "stats-truncated-tar": ("stats", lambda e, t: [_truncate(t / "ds" / "000000.tar", 3000), "--tokenizer", e["hf"]],
                            ["ds/000000.tar: unreadable tar", "copy it again"], ["stats.json"]),
    "stats-not-prepared": ("stats", lambda e, t: [e["empty"], "--tokenizer", e["hf"]],
                           ["is not a prepared energon dataset"], ["stats.json"]),
    "stats-blend-needs-output-dir": ("stats", lambda e, t: [t / "ds", t / "ds", "--tokenizer", e["hf"]],
                                     ["--output-dir is needed to blend 2 datasets"], ["stats.json"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case, env, vqa_dataset, tmp_path, capsys):  # noqa: F811
    cmd, build, expect, absent = CASES[case]
    if cmd == "stats":
        shutil.copytree(vqa_dataset.output, tmp_path / "ds")  # a dataset gets its stats.json by default
    args = build(env, tmp_path)
    rc, text = run_command(cmd, args, capsys)
    assert_flags_exist(cmd, text)
    assert_clean_failure(rc, text, expect, [tmp_path / a for a in absent] + (
        [tmp_path / "ds" / "stats.json", tmp_path / "ds" / "metadataset.yaml", tmp_path / "metadataset.yaml"]
        if cmd == "stats" else []))


# ---- an output that is, contains or lies inside an input: refused before anything is touched (issue 27) ---------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


def _run_of(e, t) -> Path:
    """A training run's layout: checkpoint iter_0000010 + tracker + tokenizer/, copied from the converted one."""
    run = _copy(e["meg"], t / "runs" / "stage1")
    (run / "release").rename(run / "iter_0000010")
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    return run


def _symlink(target: Path, link: Path) -> Path:
    link.symlink_to(target, target_is_directory=True)
    return link


def _relative_case(e, t, cd):
    """--megatron-dir given relative to the working directory, holding the HF model."""
    hf = _copy(e["hf"], t / "models" / "hf")
    cd(t)
    return (["--hf-dir", hf, "--megatron-dir", "models", "--overwrite"], t / "models",
            [f"--megatron-dir models (= {t / 'models'}) contains --hf-dir {hf}", "would delete the input"])


# Each builder gets (env, tmp_path, chdir) and returns (arguments, the input tree that must survive, words the
# message must hold). Inputs are copies under tmp_path: a failed refusal must not delete the session's models.
OVERLAP = {
    "h2m-out-is-hf": ("h2m", lambda e, t, cd: (
        ["--hf-dir", h := _copy(e["hf"], t / "hf"), "--megatron-dir", h, "--overwrite"], h,
        [f"--megatron-dir {h} is the same as --hf-dir {h}", "choose another --megatron-dir"])),
    "h2m-out-symlink-to-hf": ("h2m", lambda e, t, cd: (
        ["--hf-dir", h := _copy(e["hf"], t / "hf"), "--megatron-dir", _symlink(h, t / "link"), "--overwrite"], h,
        [f"--megatron-dir {t / 'link'} (= {h}) is the same as --hf-dir {h}"])),
    "h2m-out-contains-hf-relative": ("h2m", lambda e, t, cd: _relative_case(e, t, cd)),
    "h2m-out-inside-hf": ("h2m", lambda e, t, cd: (
        ["--hf-dir", h := _copy(e["hf"], t / "hf"), "--megatron-dir", h / "meg"], h,
        [f"--megatron-dir {h / 'meg'} lies inside --hf-dir {h}"])),
    "m2h-out-is-run": ("m2h", lambda e, t, cd: (
        ["--megatron-dir", r := _run_of(e, t), "--hf-dir", r, "--overwrite"], r,
        [f"--hf-dir {r} is the same as --megatron-dir {r}"])),
    "m2h-out-parent-of-run": ("m2h", lambda e, t, cd: (
        ["--megatron-dir", r := _run_of(e, t), "--hf-dir", t / "runs", "--overwrite"], r,
        [f"--hf-dir {t / 'runs'} contains --megatron-dir {r}"])),
    "m2h-iteration-out-is-run": ("m2h", lambda e, t, cd: (
        ["--megatron-dir", (r := _run_of(e, t)) / "iter_0000010", "--hf-dir", r, "--overwrite"], r,
        [f"--hf-dir {r} contains --megatron-dir {r / 'iter_0000010'}"])),
    "m2h-iteration-out-beside-it": ("m2h", lambda e, t, cd: (
        ["--megatron-dir", (r := _run_of(e, t)) / "iter_0000010", "--hf-dir", r / "hf"], r,
        [f"--hf-dir {r / 'hf'} lies inside the checkpoint directory of --megatron-dir {r}"])),
    "m2h-out-is-its-tokenizer": ("m2h", lambda e, t, cd: (
        ["--megatron-dir", r := _run_of(e, t), "--hf-dir", r / "tokenizer", "--overwrite"], r,
        [f"--hf-dir {r / 'tokenizer'} lies inside --megatron-dir {r}"])),
    "m2h-out-is-tokenizer-dir": ("m2h", lambda e, t, cd: (
        ["--megatron-dir", e["meg"], "--tokenizer-dir", h := _copy(e["hf"], t / "hf"), "--hf-dir", h,
         "--overwrite"], h, [f"--hf-dir {h} is the same as --tokenizer-dir {h}"])),
    "build-out-is-text-model": ("build", lambda e, t, cd: (
        ["--text-model", x := _copy(e["text"], t / "text"), "--vision-model", e["vision"], "--save-dir", x,
         "--overwrite"], x, [f"--save-dir {x} is the same as --text-model {x}"])),
    "build-out-contains-vision-model": ("build", lambda e, t, cd: (
        ["--text-model", e["text"], "--vision-model", v := _copy(e["vision"], t / "models" / "vision"),
         "--save-dir", t / "models", "--overwrite"], v,
        [f"--save-dir {t / 'models'} contains --vision-model {v}"])),
    "wds-out-contains-input": ("wds", lambda e, t, cd: (
        ["--format", "vqa", "--input", (d := _copy(e["root"] / "in", t / "in")) / "good.jsonl", "--output", d,
         "--overwrite", "--no-progress", "--no-prepare"], d, [f"--output {d} contains --input {d / 'good.jsonl'}"])),
    "wds-out-is-image-root": ("wds", lambda e, t, cd: (
        ["--format", "vqa", "--input", e["root"] / "in" / "good.jsonl",
         "--image-root", i := _copy(e["images"], t / "i"),
         "--output", i, "--overwrite", "--no-progress", "--no-prepare"], i,
        [f"--output {i} is the same as --image-root {i}"])),
    "wds-out-replaces-images-inside-root": ("wds", lambda e, t, cd: (
        ["--format", "vqa", "--input", e["root"] / "in" / "good.jsonl",
         "--image-root", i := _copy(e["root"] / "in", t / "i"),
         "--output", i / "images", "--overwrite", "--no-progress", "--no-prepare"], i,
        [f"--output {i / 'images'} lies inside --image-root {i}"])),
}


@pytest.mark.parametrize("case", sorted(OVERLAP))
def test_output_overlapping_an_input_is_refused(case, env, tmp_path, capsys, monkeypatch):
    cmd, build = OVERLAP[case]
    args, keep, expect = build(env, tmp_path, monkeypatch.chdir)
    before = _tree(keep)
    rc, text = run_command(cmd, args, capsys)
    assert_clean_failure(rc, text, expect)
    assert rc == 2 and text.strip().splitlines()[-1].startswith("error: ")
    assert _tree(keep) == before  # nothing touched
    assert not [p for p in tmp_path.rglob(".*tmp*")]  # and nothing started


def test_output_beside_an_input_is_fine(env, tmp_path, capsys):
    """Controls: a dataset may go inside --image-root (fresh, or replacing one make_wds wrote); the overlap rule
    compares whole path components (hf vs hf2) and object-store URLs by prefix."""
    from megatron_vlm.cli.overlap import CONTAINS, INSIDE, SAME, relation

    root = _copy(env["root"] / "in", tmp_path / "in")
    args = ["--format", "vqa", "--input", root / "good.jsonl", "--image-root", root / "images", "--output",
            root / "images" / "ds", "--no-progress", "--no-prepare"]
    for extra in ([], ["--overwrite"]):
        rc, text = run_command("wds", args + extra, capsys)
        assert rc == 0 and "wrote 2 samples" in text, text
    assert relation(tmp_path / "hf2", tmp_path / "hf") is None and relation(tmp_path / "a/b/..", tmp_path / "a") == SAME
    assert relation("msc://s3/runs/a/hf", "msc://s3/runs/a") == INSIDE
    assert relation("msc://s3/runs/", "msc://s3/runs/a") == CONTAINS
    assert relation("msc://s3/runs/ab", "msc://s3/runs/a") is None and relation("msc://s3/x", tmp_path) is None


# ---- faults the environment causes: tests/test_convert_errors.py (the export runs megatron-core's reader) ---


# ---- positive controls: the refusals above are not blanket refusals --------------------------------------------
def test_symlink_flag_and_inside_links(env, tmp_path, capsys):
    rc, text = run_command("wds", _wds(["--max-bad-fraction", "0", "--allow-symlinks-outside-image-root"],
                                       inp="link.jsonl")(env, tmp_path), capsys)
    assert rc == 0, text
    assert "wrote 3 samples" in text  # the inside link and, with the flag, the outside one
    rc, text = run_command("wds", _wds(["--max-bad-fraction", "0"])(env, tmp_path / "b"), capsys)
    assert rc == 0 and "wrote 2 samples" in text, text
    rc, text = run_command("wds", ["--help"], capsys)
    assert "--allow-symlinks-outside-image-root" in text and "symlinks whose target" in text


def test_stats_stays_bounded_on_a_huge_sample(env, tmp_path, capsys):
    """A 1,100,000-character answer (accepted with a raised --max-text-chars) is counted, not tokenized."""
    rc, text = run_command("wds", _wds(["--max-text-chars", "2000000"], inp="huge.jsonl")(env, tmp_path), capsys)
    assert rc == 0, text
    from megatron_vlm.data.prepare import run_energon_prepare
    ds = tmp_path / "ds"
    run_energon_prepare(ds, "vqa", {"train": sorted(p.name for p in ds.glob("*.tar")), "val": [], "test": []})
    t0 = time.perf_counter()
    rc, text = run_command("stats", [ds, "--tokenizer", env["hf"], "--seq-length", "64", "--no-progress"], capsys)
    elapsed = time.perf_counter() - t0
    assert rc == 0, text
    st = json.loads((ds / "stats.json").read_text())["datasets"][str(ds)]["train"]
    assert (st["samples"], st["images"], st["too_long_to_count"], st["over_seq_length"]) == (3, 3, 1, 1)
    assert st["text_tokens"] < 100  # only the two small samples were tokenized
    assert elapsed < 20, elapsed


# ---- train/run.py: the launcher checks the run it resumes and the data before any rank starts -------------------
def _train_case(env, tmp_path, vqa_ds, how):
    args = base_args(tmp_path)
    run = tmp_path / "out" / "llava-stage1"
    if how == "load_truncated":
        d = damaged_checkpoint(env, tmp_path / "load", "truncate_shard")
        args[args.index("--megatron-load-dir") + 1] = str(d)
        return args
    if how in ("resume_tracker", "resume_missing_iter", "resume_truncated"):
        run.mkdir(parents=True)
        if how == "resume_tracker":
            (run / "latest_checkpointed_iteration.txt").write_text("\x00\x00garbage")
        elif how == "resume_missing_iter":
            (run / "latest_checkpointed_iteration.txt").write_text("40")
        else:
            shutil.copytree(env["meg"] / "release", run / "iter_0000010")
            (run / "latest_checkpointed_iteration.txt").write_text("10")
            shard = sorted((run / "iter_0000010").glob("*.distcp"))[0]
            shard.write_bytes(shard.read_bytes()[:100])
        return args + ["--train-iters", "20"]  # beyond iteration 10: a resume (a finished run is not started)
    if how in ("resume_older_damaged", "resume_older_manifest", "ckpt_step_absent", "ckpt_step_older",
               "load_run_damaged"):
        # a run with complete iterations 5 and 10, the tracker at 10
        for it in (5, 10):
            shutil.copytree(env["meg"] / "release", run / f"iter_{it:07d}")
        (run / "latest_checkpointed_iteration.txt").write_text("10")
        it10 = run / "iter_0000010"
        if how in ("resume_older_damaged", "ckpt_step_older", "load_run_damaged"):
            shard = sorted(it10.glob("*.distcp"))[0]
            shard.write_bytes(shard.read_bytes()[:100])
        elif how == "resume_older_manifest":
            from megatron_vlm.checkpoint import manifest

            manifest.write(it10, manifest.entries(it10, manifest.files_of(it10)))
            (it10 / "vlm_spec.json").write_text((it10 / "vlm_spec.json").read_text() + "\n")
        if how == "load_run_damaged":  # a new run whose --megatron-load-dir is that run
            args[args.index("--megatron-load-dir") + 1] = str(run)
            return args + ["--name", "next"]
        extra = {"ckpt_step_absent": ["--ckpt-step", "7"], "ckpt_step_older": ["--ckpt-step", "5"]}.get(how, [])
        return args + ["--train-iters", "20"] + extra
    if how in ("resume_other_stage", "resume_other_schedule"):
        # a stage-1 run directory at iteration 10 whose ckpt_meta.json records what it trained and its schedule
        it_dir = run / "iter_0000010"
        shutil.copytree(env["meg"] / "release", it_dir)
        (run / "latest_checkpointed_iteration.txt").write_text("10")
        meta = json.loads((it_dir / "ckpt_meta.json").read_text())
        saved_with = dict(max_lr=1e-3, min_lr=0.0, lr_decay_steps=10, lr_warmup_steps=0, lr_decay_style="cosine",
                          start_wd=0.0, end_wd=0.0, wd_incr_steps=10, wd_incr_style="constant")  # stage 1, 10 iters
        meta.update(iteration=10, extra={"stage": 1, "trained": ["projector"], "optimizer": True,
                                         "schedule": saved_with})
        (it_dir / "ckpt_meta.json").write_text(json.dumps(meta))
        # (stage 2 reusing stage 1's --name, the mistake of issue 27 item 5)
        return args + ["--train-iters", "20"] + (["--stage", "2", "--name", "llava-stage1"]
                                                 if how == "resume_other_stage" else [])
    if how in ("spec_copies", "spec_tensors"):
        d = tmp_path / "meg_copy"
        shutil.copytree(env["meg"], d)
        spec = json.loads((d / "vlm_spec.json").read_text())
        if how == "spec_copies":  # the directory's copy no longer says what the iteration holds
            (d / "vlm_spec.json").write_text(json.dumps({**spec, "num_layers": spec["num_layers"] + 1}))
        else:  # both copies agree, and neither describes the tensors (another vocabulary)
            for f in (d / "vlm_spec.json", d / "release" / "vlm_spec.json"):
                f.write_text(json.dumps({**spec, "vocab_size": 400}))
        args[args.index("--megatron-load-dir") + 1] = str(d)
        return args
    if how == "tokenizer_corrupt":
        (Path(args[args.index("--tokenizer-load-dir") + 1]) / "tokenizer_config.json").write_text("{not json")
        return args
    if how == "save_is_load":  # --save-dir/--name is the checkpoint the run starts from
        load = Path(args[args.index("--megatron-load-dir") + 1])
        return args + ["--save-dir", str(load.parent), "--name", load.name]
    ds = tmp_path / "data_copy"
    shutil.copytree(vqa_ds.output, ds)
    i = args.index("--data-path") + 1
    if how == "eval_no_val":
        (ds / ".nv-meta" / "split.yaml").write_text("split_parts:\n  train:\n  - '{000000..000004}.tar'\n"
                                                    "  val: []\n  test: []\nexclude: []\n")
        args[i] = str(ds)
        return args + ["--eval-iters", "2"]
    if how == "save_in_data":
        args[i] = str(ds)
        return args + ["--save-dir", str(ds / "runs")]
    if how == "data_truncated":
        tar = ds / "000000.tar"
        tar.write_bytes(tar.read_bytes()[:1000])
        args[i] = str(ds)
    elif how == "data_missing_shard":
        (ds / "000001.tar").unlink()
        args[i] = str(ds)
    elif how in ("blend_zero", "blend_missing"):
        blend = tmp_path / "blend.yaml"
        weight, path = (0.0, ds) if how == "blend_zero" else (1.0, tmp_path / "gone")
        blend.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                         f"    - {{weight: {weight}, path: {path}, split_part: train}}\n")
        args[i] = str(blend)
    return args


def test_ckpt_step_resumes_an_older_iteration(env, vqa_dataset, tmp_path, capsys):  # noqa: F811
    """The positive control of the rows above: with --ckpt-step 5 the same run passes every check (the damaged
    iteration 10 is not read)."""
    args = _train_case(env, tmp_path, vqa_dataset, "ckpt_step_older")
    for flag in ("--image-token-id", "--pad-token-id", "--tokenizer-load-dir"):  # the converted model's own
        i = args.index(flag)
        del args[i:i + 2]
    args += ["--tokenizer-load-dir", str(env["hf"])]
    rc, text = run_command("train", args + ["--dry-run"], capsys)
    assert rc == 0, text
    rc, text = run_command("train", [a for a in args if a != "5" and a != "--ckpt-step"] + ["--dry-run"], capsys)
    assert rc == 2 and "--ckpt-step 5" in text, text  # without it: refused, naming it


@pytest.mark.parametrize("how,expect", [
    ("resume_tracker", ["cannot resume the run in", "latest_checkpointed_iteration.txt reads", "another --name"]),
    ("resume_missing_iter", ["iter_0000040 does not exist", "available: none",
                             "the run holds no other complete iteration: start a new run with another --name"]),
    ("resume_truncated", ["iter_0000010/", ".distcp: truncated", "the run holds no other complete iteration"]),
    # issue 42: a damaged iteration names the newest complete one and --ckpt-step
    ("resume_older_damaged", ["cannot resume the run in", "iter_0000010/__0_0.distcp: truncated",
                              "resume from its newest complete iteration with --ckpt-step 5"]),
    ("resume_older_manifest", ["iter_0000010/vlm_spec.json: ", "bytes, its checksums.json says",
                               "resume from its newest complete iteration with --ckpt-step 5"]),
    ("ckpt_step_absent", ["iter_0000007 does not exist", "available: iter_0000005, iter_0000010",
                          "with --ckpt-step 10"]),
    ("load_run_damaged", ["--megatron-load-dir", "iter_0000010/__0_0.distcp: truncated",
                          "load its newest complete iteration with --ckpt-step 5"]),
    ("load_truncated", ["--megatron-load-dir", "release/__0_0.distcp: truncated"]),
    ("data_truncated", ["000000.tar is truncated (1000 bytes"]),
    ("data_missing_shard", ["000001.tar is missing"]),
    ("blend_zero", ["blend.yaml: split 'train' blends no dataset with a positive weight"]),
    ("blend_missing", ["gone: no such file or directory", "blend.yaml, split 'train'"]),
    # issue 27: a resume the checkpoint cannot serve, a spec that does not describe the weights, every input
    ("resume_other_stage", ["holds the optimizer state of a stage-1 run that trained the projector",
                            "trains the projector and language model (--stage 2)", "another --name",
                            "pass --no-load-optim"]),
    ("resume_other_schedule", ["another learning-rate schedule: --train-iters 10 (this run: 20)",
                               "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"]),
    ("spec_copies", ["meg_copy/vlm_spec.json disagrees with", "release/vlm_spec.json (num_layers 3 vs 2)"]),
    ("spec_tensors", ["release/vlm_spec.json does not describe the checkpoint's tensors",
                      "language_model.embedding.word_embeddings.weight has shape (384, 64), the spec gives (512, 64)"]),
    ("tokenizer_corrupt", ["tok/tokenizer_config.json: invalid JSON"]),
    ("eval_no_val", ["has an empty 'val' split and --eval-iters 2 evaluates on it", "or pass --eval-iters 0"]),
    ("save_in_data", ["runs/llava-stage1 lies inside --data-path", "choose another --save-dir or --name"]),
    ("save_is_load", ["/ckpt is --megatron-load-dir", "would write its checkpoints into its own input"]),
    ("lr_nan", ["--lr nan: must be a finite number"]),
    ("seed_negative", ["--seed -1: must not be negative"]),
])
def test_launcher_refuses_before_starting(how, expect, env, vqa_dataset, tmp_path, capsys):  # noqa: F811
    extra = {"lr_nan": ["--lr", "nan"], "seed_negative": ["--seed", "-1"]}.get(how, [])
    args = _train_case(env, tmp_path, vqa_dataset, how) + extra
    rc, text = run_command("train", args + ["--dry-run"], capsys)
    assert rc == 2
    assert_clean_failure(rc, text, expect)
    assert_flags_exist("train", text)
    rc, text = run_command("train", args, capsys)  # a real launch stops there too: nothing written, nothing started
    assert rc == 2 and not list(tmp_path.glob("**/llava-stage*/config.yaml"))


def _parsers(parser):
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_command_takes_an_abbreviated_flag(capsys):
    """argparse's prefix matching is off on every command (and sub-command), as Megatron-LM turns it off: a flag
    that is only the start of one (``--cp`` of ``--cpus-per-task`` before --cp existed, ``--seq`` of
    ``--seq-length``) is named as unknown instead of silently standing for it. Also every parser in the source,
    commands run as modules included."""
    checked = []
    for path in sorted(set(scripts().values())):
        if "__main__" not in path.read_text():
            continue  # a module of another script (demo/shapes.py)
        try:
            parser = command_parser(path)[0]
        except AssertionError as e:
            if "parsed nothing" in str(e):  # a command without flags (tools/sizing_table.py)
                continue
            raise
        for p in _parsers(parser):
            assert p.allow_abbrev is False, f"{path.relative_to(ROOT)}: {p.prog} allows abbreviations"
        checked.append(path)
    assert len(checked) > 20, checked
    unset = [f"{f.relative_to(ROOT)}:{n}" for d in ("convert", "data_prep", "train", "eval", "demo", "bench",
                                                    "tools", "megatron_vlm")
             for f in sorted((ROOT / d).rglob("*.py"))
             for n, line in enumerate(f.read_text().splitlines(), 1)
             if re.search(r"(ArgumentParser|add_parser)\(", line) and "allow_abbrev=False" not in line]
    assert not unset, unset
    rc, text = run_command("train", ["--seq", "64"], capsys)
    assert rc == 2 and "unrecognized arguments: --seq" in text, text
    from megatron_vlm.training.config import build_parser

    ns = build_parser().parse_args(["--cp", "2"])
    assert ns.cp == 2 and not hasattr(ns, "cpus_per_task")


# ---- the torchrun path (subprocesses): a rank's reason printed last; Ctrl-C saves and exits 130 --------------------
FAILING_RANK = textwrap.dedent("""
    import runpy, sys, types
    sys.path.insert(0, {repo!r})
    fake = types.ModuleType("megatron_vlm.training.trainer")
    def train(cfg):
        raise ValueError(f"--data-path {{cfg.data_path}}: sample 000000007 has no image part")
    fake.train = train
    sys.modules["megatron_vlm.training.trainer"] = fake  # the rank fails inside train(), as a real one would
    dist = types.ModuleType("megatron_vlm.runtime.distributed")
    dist.teardown = lambda: None  # (spares the test importing megatron-core)
    dist.choose_device = lambda device=None: "cpu"
    sys.modules["megatron_vlm.runtime.distributed"] = dist
    sys.exit(runpy.run_path({entry!r}, run_name="pretrain")["run"]())
""")


@pytest.mark.slow
def test_rank_failure_reason_is_printed_last(tmp_path):
    entry = tmp_path / "failing_rank.py"
    entry.write_text(FAILING_RANK.format(repo=str(REPO), entry=str(REPO / "train" / "pretrain_vlm.py")))
    environ = dict(os.environ, MEGATRON_VLM_ENTRYPOINT=str(entry))
    environ = {k: v for k, v in environ.items() if not k.startswith("SLURM_")}
    p = forked_cli.run([sys.executable, str(REPO / "train" / "run.py"), *base_args(tmp_path), "-g", "1",
                        "--gbs", "16"], env=environ, capture_output=True, text=True, timeout=120)
    log = p.stdout + p.stderr
    assert p.returncode == 1, log
    assert "Traceback" not in log and "ChildFailedError" not in log, log
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("[train/run.py] rank 0 failed: --data-path ") and "sample 000000007 has no image" in last
    tb = tmp_path / "out" / "llava-stage1" / "failures" / "rank0.traceback.txt"
    assert str(tb) in last and "ValueError" in tb.read_text()


# a rank failing inside torch.distributed.checkpoint: its CheckpointException derives from BaseException
RANK_FAULTS = {
    # a full disk during a training save; the run directory cannot take the failure report either
    "full_disk_during_save": (
        "from torch.distributed.checkpoint.api import CheckpointException\n"
        "    path = cfg.checkpoint_dir + '/.iter_0000002.tmp/__0_0.distcp'\n"
        "    raise CheckpointException('save', {0: OSError(errno.ENOSPC, 'No space left on device', path)})",
        "{run}/.iter_0000002.tmp/__0_0.distcp: no space left on the device; free space there or write to another "
        "directory"),
    # vlm_spec.json disagreeing with the tensors: megatron's global shape check while loading
    "spec_disagrees_with_tensors": (
        "from torch.distributed.checkpoint.api import CheckpointException\n"
        "    from megatron.core.dist_checkpointing.core import CheckpointingException\n"
        "    raise CheckpointException('load', {0: CheckpointingException('Global shape mismatch for loaded "
        "(torch.Size([384, 64])) and expected ((512, 64)) tensor for key "
        "language_model.embedding.word_embeddings.weight')})",
        "the checkpoint's tensor language_model.embedding.word_embeddings.weight has shape (384, 64), and the model "
        "built from its vlm_spec.json expects (512, 64): vlm_spec.json does not describe these weights; restore the "
        "vlm_spec.json that was saved with them"),
}
RANK_FAULT = textwrap.dedent("""
    import errno, runpy, sys, types
    sys.path.insert(0, {repo!r})
    fake = types.ModuleType("megatron_vlm.training.trainer")
    def train(cfg):
        {fault}
    fake.train = train
    sys.modules["megatron_vlm.training.trainer"] = fake
    dist = types.ModuleType("megatron_vlm.runtime.distributed")
    dist.teardown = lambda: None
    dist.choose_device = lambda device=None: "cpu"
    sys.modules["megatron_vlm.runtime.distributed"] = dist
    sys.exit(runpy.run_path({entry!r}, run_name="pretrain")["run"]())
""")


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(RANK_FAULTS))
def test_rank_faults_in_the_checkpoint_layer_end_in_one_line(fault, tmp_path):
    code, reason = RANK_FAULTS[fault]
    entry = tmp_path / "failing_rank.py"
    entry.write_text(RANK_FAULT.format(repo=str(REPO), entry=str(REPO / "train" / "pretrain_vlm.py"), fault=code))
    run = tmp_path / "out" / "llava-stage1"
    if fault == "full_disk_during_save":  # the report cannot go to <run>/failures: the launcher's fallback takes it
        run.mkdir(parents=True)
        (run / "failures").write_text("not a directory")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    environ["MEGATRON_VLM_ENTRYPOINT"] = str(entry)
    p = forked_cli.run([sys.executable, str(REPO / "train" / "run.py"), *base_args(tmp_path), "-g", "1",
                        "--gbs", "16"], env=environ, capture_output=True, text=True, timeout=300)
    log = p.stdout + p.stderr
    assert p.returncode == 1, log
    assert "Traceback" not in log, log
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("[train/run.py] rank 0 failed: " + reason.format(run=run)), last


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write: chmod for a user; for root (CI), whom permissions do not stop, a read-only
    tmpfs mounted there."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot make a read-only directory here (root, and mount failed: {r.stderr.strip()})")
    yield d
    subprocess.run(["umount", str(d)], check=True)


@pytest.mark.slow
def test_read_only_save_dir_is_refused_before_starting(read_only_dir, tmp_path, capsys):
    args = base_args(tmp_path)
    args[args.index("--save-dir") + 1] = str(read_only_dir / "runs")
    rc, text = run_command("train", args, capsys)
    assert_clean_failure(rc, text, [f"--save-dir/--name {read_only_dir}/runs/llava-stage1: cannot write in "
                                    f"{read_only_dir} (", "); choose a directory you can write"])
    assert rc == 2 and not (read_only_dir / "runs").exists()


@pytest.mark.slow
def test_ctrl_c_exits_130_without_traceback(tmp_path):
    out = tmp_path / "seen"
    out.mkdir()
    p = launcher([*base_args(tmp_path), "-g", "2", "--gbs", "32"], out, mode="signal")
    log = signal_when_ready(p, out, signal.SIGINT)
    assert [(out / f"signal{r}.txt").read_text() for r in (0, 1)] == ["SIGINT", "SIGINT"], log  # ranks saved
    assert p.returncode == 130, log
    assert "Traceback" not in log and "SignalException" not in log, log
    assert "stopped by SIGINT" in log


def test_known_faults_raised_deep_inside_libraries_read_as_one_line():
    """What a rank or a converter meets mid-write: torch.save's zip writer on a full disk, a torch.distributed
    checkpoint failure wrapping a missing file or a full disk."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_vlm.cli import describe_error

    zip_full = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    assert "most likely the disk is full" in describe_error(zip_full)
    gone = FileNotFoundError(errno.ENOENT, "No such file or directory", "/ckpt/iter_0000010/__0_1.distcp")
    line = describe_error(CheckpointException("load failed", {0: gone}))
    assert line == "/ckpt/iter_0000010/__0_1.distcp: no such file or directory; check the path"
    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/iter_0000020/__0_0.distcp")
    assert describe_error(CheckpointException("save failed", {1: full})) == (
        "/ckpt/iter_0000020/__0_0.distcp: no space left on the device; free space there or write to another "
        "directory")
    line = describe_error(CheckpointException("load failed", {0: EOFError()}))
    assert "EOFError" in line and ".distcp shard is missing or truncated" in line
    assert describe_error(KeyError("x")) is None  # an unexpected error stays a bug report (traceback with -v)


# ---- real training runs (issue 27 items 2, 5, 6): one finished run, shared --------------------------------------
def _run_args(env, data, save_dir, *extra, iters=4):
    return ["--device", "cpu", "-g", "1", "--megatron-load-dir", str(env["meg"]), "--tokenizer-load-dir",
            str(env["hf"]), "--data-path", str(data), "--save-dir", str(save_dir), "--name", "s1",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "64", "--log-interval", "1",
            "--num-workers", "1", "--lr-warmup-fraction", "0", "--train-iters", str(iters), *extra]


def _train(argv, timeout=600):
    t0 = time.perf_counter()
    p = forked_cli.run([sys.executable, str(REPO / "train" / "run.py"), *argv], capture_output=True, text=True,
                       timeout=timeout, env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0


def _metrics(run_dir) -> dict[int, dict]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if "lr" in r}


@pytest.fixture(scope="module")
def finished_run(env, tmp_path_factory):
    """A 4-iteration stage-1 run (cosine schedule, decayed to lr 0 at its end) and its data."""
    from tests.data_fixtures import _prepared, build_vqa_inputs

    data = _prepared("vqa_ds", tmp_path_factory, "vqa", "jsonl", build_vqa_inputs, shard_size=2).output
    save = tmp_path_factory.mktemp("guards") / "runs"
    rc, out, _ = _train(_run_args(env, data, save))
    assert rc == 0, out[-4000:]
    assert "start-up (" in out and "building the data loader" in out  # the phases before the first iteration
    assert "fusions: all off (automatic: device cpu: fused kernels run on CUDA only)" in out
    assert "loss: HF's objective: padded vocabulary rows are masked out of the softmax (vocabulary " in out
    assert sorted(_metrics(save / "s1")) == [1, 2, 3, 4] and _metrics(save / "s1")[4]["lr"] == 0.0
    return dict(data=data, save=save, run=save / "s1")


@pytest.mark.slow
def test_rerunning_a_finished_run_says_so_and_starts_nothing(env, finished_run):
    before = (finished_run["run"] / "metrics.jsonl").read_text()
    rc, out, took = _train(_run_args(env, finished_run["data"], finished_run["save"]))
    assert rc == 0, out
    assert out.strip().splitlines()[-1] == (
        f"[train/run.py] {finished_run['run']} is already at iteration 4 of --train-iters 4: nothing to train. To "
        "train further, raise --train-iters and pass --override-opt-param-scheduler (this command line's "
        "learning-rate schedule) or --use-checkpoint-opt-param-scheduler (the checkpoint's); to start over, use "
        "another --name")
    assert "node 0/1:" not in out and (finished_run["run"] / "metrics.jsonl").read_text() == before  # no rank ran
    assert took < 30, took  # decided before anything heavy is imported (0.7 s measured)


@pytest.mark.slow
def test_extending_a_finished_run_follows_the_chosen_schedule_and_a_full_disk_ends_in_one_line(env, finished_run,
                                                                                             tmp_path):
    """Without a flag the extension is refused before launch (it would train at lr 0); with
    --override-opt-param-scheduler iterations 5-8 train on the 8-iteration cosine. The extension runs on a
    tmpfs too small for its checkpoint: the save fails, the last line says why. Where no tmpfs can be mounted
    (not root) only the extension is checked, and under CI=true that fails."""
    rc, out, _ = _train(_run_args(env, finished_run["data"], finished_run["save"], iters=8))
    assert rc == 2 and "node 0/1:" not in out, out
    assert "--override-opt-param-scheduler" in out and "--use-checkpoint-opt-param-scheduler" in out
    assert "--train-iters 4 (this run: 8)" in out

    small = tmp_path / "small"
    small.mkdir()
    # room for a copy of the run and its logs, not for another checkpoint (~0.8 MB); tmpfs counts whole pages
    pages = sum(-(-f.stat().st_size // 4096) + 1 for f in finished_run["run"].rglob("*")) + 64
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={pages * 4}k", "tmpfs",
                                                    str(small)], capture_output=True).returncode == 0
    try:
        shutil.copytree(finished_run["run"], small / "s1")
        rc, out, _ = _train(_run_args(env, finished_run["data"], small, "--override-opt-param-scheduler", iters=8))
        lrs = {i: r["lr"] for i, r in _metrics(small / "s1").items() if i > 4}
        assert lrs == pytest.approx({i: 1e-3 * 0.5 * (1 + math.cos(math.pi * i / 8)) for i in (5, 6, 7, 8)},
                                    rel=1e-6, abs=1e-12), out[-3000:]
        assert lrs[5] > 3e-4  # not lr 0: the run trains
        assert "resume: --override-opt-param-scheduler: this command line's learning-rate schedule" in out
        if mounted:
            assert rc == 1 and "Traceback" not in out, out[-4000:]
            last = out.strip().splitlines()[-1]
            assert last.startswith(f"[train/run.py] rank 0 failed: saving checkpoint {small}/s1/iter_0000008: no "
                                   "space left on the device; free space there or write to another directory"), last
            assert (small / "s1" / "latest_checkpointed_iteration.txt").read_text() == "4"  # the tracker: untouched
            assert not (small / "s1" / "iter_0000008").exists()
        else:  # no full disk to run into: the extension alone is checked, and under CI that is a failure
            assert rc == 0, out[-3000:]
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail("could not mount a small tmpfs (needs root and mount): the full-disk save was not "
                            "checked; under CI it must be")
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_and_says_so(env, finished_run, tmp_path):
    """fp16 at a loss scale of 2^17: the per-token loss sum times the scale overflows fp16's 65,504 in the
    backward, megatron-core's scaler skips the step and halves the scale (hysteresis 1), and the log says so."""
    rc, out, _ = _train(_run_args(env, finished_run["data"], tmp_path, "--precision", "fp16", "--initial-loss-scale",
                                  str(2 ** 17), "--hysteresis", "1", iters=8))
    assert rc == 0, out[-4000:]
    rows = _metrics(tmp_path / "s1")
    skipped = [i for i, r in rows.items() if r["grad_norm"] is None]
    assert skipped and skipped == list(range(1, len(skipped) + 1)) and len(skipped) < 8, rows  # then it trains
    for i in skipped:  # each overflowing step halves the scale
        scale = 2 ** (17 - i + 1)
        assert f"iteration {i} skipped: fp16 gradients overflowed at loss scale {scale}; the scaler backs off " \
               f"(loss scale now {scale // 2})" in out, out[-4000:]
    assert all(math.isfinite(r["loss"]) for r in rows.values()), rows


@pytest.mark.slow
def test_a_resume_keeps_the_loss_objective_it_was_trained_with(env, finished_run):
    """The run trained with HF's objective (the default: padded vocabulary rows masked out of the loss), its
    checkpoint records it, and asking its resume for Megatron-LM's objective is refused before launch."""
    import json

    meta = json.loads((finished_run["run"] / "iter_0000004" / "ckpt_meta.json").read_text())
    assert meta["extra"]["loss_over_padded_vocab"] is False, meta
    rc, out, _ = _train(_run_args(env, finished_run["data"], finished_run["save"], "--loss-over-padded-vocab",
                                  "--override-opt-param-scheduler", iters=8))
    assert rc == 2 and "node 0/1:" not in out, out
    assert "was trained with HF's objective" in out and "a resumed run keeps its objective" in out, out


@pytest.mark.slow
def test_stage2_reusing_the_stage1_name_is_refused_before_launch_and_inside_the_ranks(env, finished_run, tmp_path):
    stage2 = ("--stage", "2", "--override-opt-param-scheduler")
    rc, out, _ = _train(_run_args(env, finished_run["data"], finished_run["save"], *stage2, iters=8))
    assert rc == 2 and "node 0/1:" not in out, out
    assert "stage-1 run that trained the projector" in out and "another --name" in out and "--no-load-optim" in out
    # a checkpoint that does not record what it trained (older megatron-vlm): the ranks find it in the tensors
    old = tmp_path / "runs"
    shutil.copytree(finished_run["run"], old / "s1")
    meta_file = old / "s1" / "iter_0000004" / "ckpt_meta.json"
    meta = json.loads(meta_file.read_text())
    for key in ("trained", "schedule", "stage"):
        meta["extra"].pop(key)
    meta_file.write_text(json.dumps(meta))
    rc, out, _ = _train(_run_args(env, finished_run["data"], old, *stage2, iters=8))
    assert rc == 1 and "Traceback" not in out, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"[train/run.py] rank 0 failed: {old}/s1/iter_0000004 holds no optimizer state for "), last
    assert "pass --no-load-optim" in last and "another --name" in last
