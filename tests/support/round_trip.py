"""The check of a conversion round trip: two HF directories hold the same tensors under the same names, byte for
byte with their dtypes."""

from __future__ import annotations

import torch

from megatron_vlm.convert.hf_io import HFReader


def assert_same_bytes(src, out) -> list[str]:
    """Every tensor of ``src`` in ``out`` under its name, with its dtype and bytes (and no other tensor); returns
    the names."""
    a, b = HFReader(src), HFReader(out)
    assert a.names() == b.names()
    for n in a.names():
        ta, tb = a.get(n), b.get(n)
        assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), n
    return a.names()
