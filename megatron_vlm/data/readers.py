"""Input readers: one record at a time from jsonl / jsonl.gz / json (array) / csv, with its source.

Owns file formats and byte-level problems only (invalid UTF-8, unparsable lines); what a record *means*
is :mod:`megatron_vlm.data.conversation`'s business. Every record carries ``source`` ("qa.jsonl:17",
"llava.json[5]") and the raw ``text`` so that a rejection can point at the exact input.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from megatron_vlm.data.conversation import has_lone_surrogate

MAX_RAW_CHARS = 2000


@dataclass
class RawRecord:
    index: int  # position in the input (0-based, counts every record, bad ones included)
    source: str  # where it came from, for messages and rejected.jsonl
    text: str  # the raw record (shortened), for rejected.jsonl
    obj: dict | None = None  # the parsed record, or None when ``error`` says why not
    error: str | None = None
    raw: bytes | None = None  # an unparsed jsonl line (see :func:`parse`)


def _short(text: str) -> str:
    return text if len(text) <= MAX_RAW_CHARS else text[:MAX_RAW_CHARS] + f"... [{len(text)} chars]"


def _open_binary(path: Path):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


@contextlib.contextmanager
def _decompressing(path: Path, where=lambda: ""):
    """A truncated or corrupt ``.gz`` input is a clear error naming the file (``where()``: how far it got)."""
    try:
        yield
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"--input {path}: the gzip file is truncated or corrupt ({e}){where()}; download or "
                         "compress it again") from None


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith((".csv", ".tsv")):
        return "csv"
    if name.endswith(".json"):
        with _decompressing(path), _open_binary(path) as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        return "json" if head.startswith(b"[") else "jsonl"
    return "jsonl"


def read_records(path: str | Path) -> Iterator[RawRecord]:
    """Yield the records of ``path`` (format from the extension; ``.json`` may be an array or jsonl)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--input {path} does not exist")
    kind = _kind(path)
    yield from {"jsonl": _read_jsonl, "json": _read_json_array, "csv": _read_csv}[kind](path)


def _read_jsonl(path: Path) -> Iterator[RawRecord]:
    """Lines are only split here; :func:`parse` (run in the worker processes) decodes them."""
    index = lineno = 0
    with _decompressing(path, lambda: f" after line {lineno}"), _open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            yield RawRecord(index, f"{path.name}:{lineno}", "", raw=raw)
            index += 1


def parse(rec: RawRecord) -> RawRecord:
    """Decode and parse a jsonl line read by :func:`read_records` (no-op for already parsed records)."""
    if rec.raw is None:
        return rec
    raw, rec.raw = rec.raw, None
    rec.text = _short(raw.decode("utf-8", errors="backslashreplace").rstrip("\r\n"))
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        rec.error = f"invalid UTF-8 (byte {e.start} of the line)"
        return rec
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        rec.error = f"invalid JSON: {e}"
        return rec
    if not isinstance(obj, dict):
        rec.error = "record is not a JSON object"
    elif has_lone_surrogate(obj):
        rec.error = "invalid UTF-8 (lone surrogate escape)"
    else:
        rec.obj = obj
    return rec


def _read_json_array(path: Path) -> Iterator[RawRecord]:
    with _decompressing(path), _open_binary(path) as f:
        data = f.read()
    try:
        items = json.loads(data.decode("utf-8", errors="surrogateescape"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--input {path} is not valid JSON: {e}") from None
    if not isinstance(items, list):
        raise ValueError(f"--input {path}: expected a JSON array of records (or one JSON object per line)")
    for i, obj in enumerate(items):
        rec = RawRecord(i, f"{path.name}[{i}]", "")  # text: see record_text (only rejected ones need it)
        if not isinstance(obj, dict):
            rec.error = "record is not a JSON object"
            rec.text = record_text(obj)
        elif has_lone_surrogate(obj):
            rec.error = "invalid UTF-8"
            rec.text = record_text(obj)
        else:
            rec.obj = obj
        yield rec


def record_text(obj) -> str:
    """The (shortened) JSON text of a record, for rejected.jsonl."""
    return _short(json.dumps(obj, ensure_ascii=True))


def _read_csv(path: Path) -> Iterator[RawRecord]:
    with _decompressing(path), _open_binary(path) as f:
        text = f.read().decode("utf-8-sig", errors="surrogateescape")
    dialect = "excel-tab" if path.name.lower().removesuffix(".gz").endswith(".tsv") else "excel"
    reader = csv.DictReader(io.StringIO(text, newline=""), dialect=dialect)
    start = 2
    for i, row in enumerate(reader):
        source = f"{path.name}:{start}"
        start = reader.line_num + 1
        raw = ",".join(v if isinstance(v, str) else "" for v in row.values())
        rec = RawRecord(i, source, _short(raw.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")))
        if None in row or any(v is None for v in row.values()):
            rec.error = "CSV row has a different number of fields than the header"
        elif has_lone_surrogate(row):
            rec.error = "invalid UTF-8"
        else:
            rec.obj = dict(row)
        yield rec
