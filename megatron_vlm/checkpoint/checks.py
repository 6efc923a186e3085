"""Cheap checks of a Megatron checkpoint a command is about to read, before the heavy libraries see it.

megatron-core's dist_checkpointing and torch.distributed.checkpoint fail on a corrupt file with messages that do
not name it (a 77-line ``CheckpointException``, a bare ``EOFError``). These checks read only JSON files, the
checkpoint tracker and the torch_dist ``.metadata`` index (then compare shard sizes with it), so they take
milliseconds, and raise ``InputError`` with the file, what is wrong and what to do. Used by the converters, by the
training launcher (for the run directory it resumes) and by the trainer's resume.

What a damaged checkpoint's message tells the user to do depends on the command: the converters pick another
``--iteration`` (:data:`CONVERTER_FIX`), ``train/run.py`` resumes from another one with ``--ckpt-step``
(:mod:`megatron_vlm.launch.preflight`); :func:`newest_complete_iteration` names the one to pick.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatron_vlm.cli import InputError
from megatron_vlm.cli.inputs import read_json

TRACKER = "latest_checkpointed_iteration.txt"
#: what the converters (which take --iteration) suggest for a damaged checkpoint
CONVERTER_FIX = "re-save or re-convert it, or pick another --iteration"


ITERATION_DIR_RE = re.compile(r"iter_(\d{7})|release")


def check_iteration_matches(it_dir, iteration, flag: str = "--megatron-dir") -> None:
    """An ``--iteration`` given with an iteration directory must name that iteration."""
    if iteration is None:
        return
    name = str(it_dir).rstrip("/").rsplit("/", 1)[-1]
    m = ITERATION_DIR_RE.fullmatch(name)
    if m is None:
        raise InputError(f"--iteration {iteration}: {flag} {it_dir} is one iteration directory already (not named "
                         f"iter_XXXXXXX or release); drop --iteration, or point {flag} at the checkpoint directory "
                         "that holds it")
    have = "release" if m.group(1) is None else int(m.group(1))
    if have != (iteration if iteration == "release" else int(iteration)):
        raise InputError(f"--iteration {iteration} conflicts with {flag} {it_dir}, which is iteration {have}; drop "
                         f"--iteration, or point {flag} at the checkpoint directory {Path(str(it_dir)).parent} to "
                         "pick an iteration there")


def iteration_dir(ckpt_dir: Path, iteration=None, flag: str = "--megatron-dir", fix: str | None = None) -> Path:
    """The iteration directory ``iteration`` (or the tracker's) of a local Megatron checkpoint directory, or
    ``ckpt_dir`` itself when it is an iteration directory (``iteration``, if given, must name it). ``fix``, if
    given, ends the message of a corrupt tracker or a missing iteration directory."""
    then = f"; {fix}" if fix else ""
    if not ckpt_dir.is_dir():
        raise InputError(f"{flag} {ckpt_dir}: no such directory")
    if (ckpt_dir / "ckpt_meta.json").is_file() or (ckpt_dir / ".metadata").is_file() or \
            any(ckpt_dir.glob("mp_rank_*")):
        check_iteration_matches(ckpt_dir, iteration, flag)
        return ckpt_dir  # pointed at an iteration directory (ours, torch_dist, or legacy rank directories)
    if iteration is None:
        tracker = ckpt_dir / TRACKER
        if not tracker.is_file():
            raise InputError(f"{flag} {ckpt_dir} has no {TRACKER}: not a finished Megatron checkpoint; point at "
                             "the directory that holds it, or pass --iteration")
        text = tracker.read_text(errors="replace").strip()
        if text != "release" and not re.fullmatch(r"\d+", text):
            raise InputError(f"{tracker} reads {text[:40]!r}, expected an iteration number or 'release'; the "
                             "file is corrupt: write the number of the last complete iter_* directory into it"
                             + then)
        iteration = text
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    if not (ckpt_dir / name).is_dir():
        have = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and re.fullmatch(r"iter_\d{7}|release",
                                                                                        p.name))
        raise InputError(f"{ckpt_dir / name} does not exist (iteration {iteration} of {flag} {ckpt_dir}); "
                         f"available: {', '.join(have) or 'none'}{then}")
    return ckpt_dir / name


def check_iteration_files(it_dir: Path, fix: str = CONVERTER_FIX) -> None:
    """Every JSON file of an iteration directory parses; every file its checksum manifest lists has its size; every
    torch_dist shard is present and complete; every torch file (legacy rank files, ``common.pt``) is a complete zip
    and every legacy rank file is there. ``fix``: what to do, for the message."""
    from megatron_vlm.checkpoint import manifest

    damaged = f"the checkpoint is damaged: {fix}"
    for f in sorted(it_dir.glob("*.json")):
        read_json(f, damaged)
    try:
        files = manifest.read(it_dir)
    except ValueError as e:
        raise InputError(f"{e}; {damaged}") from None
    problems = manifest.size_problems(it_dir, files) if files is not None else []
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"{problems[0]}{more}; {damaged}")
    for f in sorted(it_dir.glob("*.safetensors")):
        check_safetensors(f, damaged)
    if (it_dir / ".metadata").is_file():
        check_distcp(it_dir, fix)
    check_legacy_ranks(it_dir, fix)
    for f in sorted(it_dir.glob("*.pt")) + sorted(it_dir.glob("mp_rank_*/*.pt")):
        check_torch_file(f, damaged)


def check_legacy_ranks(it_dir: Path, fix: str = CONVERTER_FIX) -> None:
    """Every shard of a legacy ('torch') checkpoint is in some ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` of the
    layout its directories span (:class:`megatron_vlm.checkpoint.legacy_ranks.Sources`: Megatron-LM writes only some
    (TP, EP) files at ETP < TP). The layout comes from ``ckpt_meta.json`` where there is one; Megatron-LM's names alone
    do not say whether a second number is a PP or an EP rank, so either reading passes."""
    from megatron_vlm.checkpoint import legacy_ranks as lr

    if not lr.present(it_dir, files=False):
        return
    incomplete = f"the checkpoint is incomplete: {fix}"

    def covered(expert_parallel: bool, tp=None, pp=None, ep=None, etp=None, experts=None) -> None:
        spans = lr.present(it_dir, expert_parallel, files=False)
        tp, pp, ep = (x or max(r[i] for r in spans) + 1 for i, x in enumerate((tp, pp, ep)))
        lr.Sources(it_dir, lr.present(it_dir, expert_parallel), tp, pp, ep, etp,
                   expert_parallel if experts is None else experts, incomplete)

    try:
        meta = read_json(it_dir / "ckpt_meta.json", incomplete) if (it_dir / "ckpt_meta.json").is_file() else None
        if meta is not None and meta.get("format") == "torch":
            ep, tp, etp = int(meta.get("ep") or 1), int(meta["tp"]), meta.get("etp")
            covered(ep > 1, tp, int(meta["pp"]), ep, etp, ep > 1 or (etp or tp) != tp)
        elif any(re.fullmatch(r"mp_rank_\d{2}_\d{3}_\d{3}", d.name) for d in it_dir.glob("mp_rank_*")):
            covered(True, etp=1)  # PP and EP ranks: each EP rank's experts in some file
        else:
            try:
                covered(False)  # mp_rank_TT[_PPP]
            except lr.CheckpointLayoutError as as_pp:
                try:
                    covered(True, etp=1)  # or mp_rank_TT_EEE, written sparsely by Megatron-LM at ETP < TP
                except lr.CheckpointLayoutError:
                    raise as_pp from None
    except lr.CheckpointLayoutError as e:
        raise InputError(str(e)) from None


def check_torch_file(f: Path, fix: str) -> None:
    """A ``torch.save`` file (a zip archive): its central directory reads and its last member ends within the file.
    Files in torch's pre-zip format are not checked."""
    import zipfile

    size = f.stat().st_size
    with open(f, "rb") as fh:
        if fh.read(4) != b"PK\x03\x04":
            return
        try:
            with zipfile.ZipFile(fh) as z:
                infos = z.infolist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise InputError(f"{f}: truncated or corrupt ({size} bytes; {e}); {fix}") from None
        if not infos:
            return
        last = max(infos, key=lambda i: i.header_offset)
        fh.seek(last.header_offset)
        header = fh.read(30)  # the local header: its name and extra-field lengths (torch pads data there)
        end = last.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
            int.from_bytes(header[28:30], "little") + last.compress_size if len(header) == 30 else size + 1
    if end > size:
        raise InputError(f"{f}: truncated ({size} bytes, its zip directory needs {end}); {fix}")


def resume_fix(run_dir, damaged) -> str:
    """What ``train/run.py`` says to do when the iteration it would resume from (``damaged``) is damaged: resume from
    the run's newest complete other iteration with ``--ckpt-step``, else start a new run."""
    other = newest_complete_iteration(run_dir, other_than=damaged)
    if other is None:
        return "the run holds no other complete iteration: start a new run with another --name"
    return f"resume from its newest complete iteration with --ckpt-step {other}, or start a new run with another --name"


def newest_complete_iteration(ckpt_dir, other_than=None) -> int | None:
    """The newest ``iter_XXXXXXX`` of a checkpoint directory, other than ``other_than``, that a save finished (it
    holds ``ckpt_meta.json``, which a save writes last, or Megatron-LM's ``metadata.json`` / rank files) and that
    passes :func:`check_iteration_files`; None if there is none. Reads JSON files and file sizes only."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return None
    its = sorted((int(p.name[5:]) for p in d.iterdir() if re.fullmatch(r"iter_\d{7}", p.name) and p.is_dir()),
                 reverse=True)
    for it in its:
        if other_than is not None and other_than != "release" and it == int(other_than):
            continue
        it_dir = d / f"iter_{it:07d}"
        if not ((it_dir / "ckpt_meta.json").is_file() or (it_dir / "metadata.json").is_file()
                or any(it_dir.glob("mp_rank_*"))):
            continue
        try:
            check_iteration_files(it_dir)
        except InputError:
            continue
        return it
    return None


def check_safetensors(f: Path, fix: str) -> None:
    """A safetensors file's header parses and the file is as long as the header's tensors need."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError("header cut short")
            header = json.loads(fh.read(n))
        need = 8 + n + max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise InputError(f"{f}: not a readable safetensors file ({e}); {fix}") from None
    if size < need:
        raise InputError(f"{f}: truncated ({size} bytes, its header needs {need}); {fix}")


def check_distcp(it_dir: Path, fix: str = CONVERTER_FIX) -> None:
    """Compare the ``.distcp`` shards with the byte ranges torch.distributed.checkpoint's index expects (read by
    :mod:`megatron_vlm.checkpoint.dcp_index`: no torch import, no code from the file)."""
    from megatron_vlm.checkpoint.dcp_index import UnreadableIndex, read_index

    fix = f"the checkpoint is incomplete: {fix}"
    try:
        index = read_index(it_dir)
    except UnreadableIndex as e:
        raise InputError(f"{it_dir / '.metadata'}: unreadable ({e}); {fix}") from None
    for rel, size in sorted(index.shard_bytes.items()):
        f = it_dir / rel
        if not f.is_file():
            raise InputError(f"{f}: missing shard; {fix}")
        have = f.stat().st_size
        if have < size:
            raise InputError(f"{f}: truncated ({have} bytes, the checkpoint index needs {size}); {fix}")


def check_checkpoint(ckpt_dir: str | Path, iteration=None, flag: str = "--megatron-dir",
                     fix: str = CONVERTER_FIX) -> Path:
    """The iteration directory to read, after the checks above (local directories only)."""
    it_dir = iteration_dir(Path(ckpt_dir), iteration, flag, None if fix == CONVERTER_FIX else fix)
    check_iteration_files(it_dir, fix)
    return it_dir
