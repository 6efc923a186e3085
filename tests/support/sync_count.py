"""Count the calls of a training step that make the host wait for the GPU (host syncs), attributed to their caller.

On a CPU nothing syncs, so :class:`SyncCounter` counts the calls that *would* sync on a GPU, where the step's
tensors live on the device:

- a value read back: ``aten._local_scalar_dense`` (``.item()``, a tensor's ``bool()`` / ``int()`` / ``float()``),
  ``.tolist()``, ``.numpy()``, ``.cpu()`` (not ``.to("cpu")``: on a CPU run that is the device move itself),
  ``torch.tensor`` / ``torch.as_tensor`` of a list holding tensors (one read per tensor);
- a shape from values: ``aten.nonzero`` (``torch.where(mask)``), ``masked_select``, indexing or index_put with a
  boolean mask, ``repeat_interleave`` without ``output_size``, ``unique``;

but only on tensors that would be on the GPU. The host's own tensors (a batch as the loader gives it, and what is
computed from host tensors alone) are tagged: the counter starts from the tensors it is told are on the host
(``host=``, and all that ``host_functions`` make); a tensor computed (through a torch function) only from host
tensors, or made by a factory function without a ``device`` argument, is on the host too; ``Tensor.to`` with a
device, ``.cuda()`` and ``.pin_memory()`` move a tensor to the device (on a CPU the result is the same tensor: the
counter hands out an alias, so the host original keeps its tag). A factory call with any ``device`` argument counts as on the
device (over-counting a deliberate ``device="cpu"``, never under-counting). What the autograd engine runs in the
backward is on the device.

Each counted call is attributed to its caller: the innermost Python frame outside torch (``file:line function``),
so a report can say where each sync comes from. ``SyncCounter.by_site()`` gives the counts per site.

On a GPU, :class:`CudaSyncCounter` does the same with torch's own ``torch.cuda.set_sync_debug_mode("warn")``: every
synchronising CUDA call warns, and the warnings are counted by the same attribution (bench/ can use it).
"""

from __future__ import annotations

import collections
import os
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)
#: frames that only pass a call on (the CPU layer's per-op mode), never its source
_RELAYS = (_HERE, os.path.join(os.path.dirname(os.path.dirname(_HERE)), "..", "megatron_vlm", "runtime",
                               "cpu_compat.py"))

_aten = torch.ops.aten
#: dispatcher ops that read a value back or size an output from values (each one a sync on a GPU)
_SYNC_OPS = {_aten._local_scalar_dense.default: "item", _aten.nonzero.default: "nonzero",
             _aten.masked_select.default: "masked_select", _aten._unique2.default: "unique",
             _aten.unique_dim.default: "unique", _aten.unique_consecutive.default: "unique",
             _aten.nonzero_static.default: None}
_BOOL_INDEX = {_aten.index.Tensor: "bool-index", _aten.index_put.default: "bool-index_put",
               _aten.index_put_.default: "bool-index_put", _aten._index_put_impl_.default: "bool-index_put"}
_REPEAT = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
#: torch functions that read values back without a dispatcher op on a CPU tensor
_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu"}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.pin_memory}
_FACTORIES = {torch.tensor, torch.as_tensor}


def caller() -> str:
    """The innermost frame outside torch, this module and the CPU layer's mode: ``path:line function`` (path
    relative to the checkout or to site-packages)."""
    skip = {os.path.abspath(p) for p in _RELAYS}
    f = sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path not in skip and "/contextlib.py" not in path:
            return f"{_short(path)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "<torch>"


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/wt-", "/work/main/"):
        i = path.find(marker)
        if i >= 0:
            rest = path[i + len(marker):]
            return rest.split("/", 1)[1] if marker == "/wt-" else rest
    return path


class _Tags(TorchFunctionMode):
    """Propagates the host tags through torch functions and counts the reads the dispatcher does not see."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        host = self.counter.host
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        all_host = all(t in host for t in tensors)
        if self.counter.on_host:  # a function that takes and makes host tensors only
            out = func(*args, **kwargs)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    host[t] = True
            return out
        if func in _READS and args and isinstance(args[0], torch.Tensor) and args[0] not in host:
            if func is not torch.Tensor.cpu or args[0].device.type != "meta":
                self.counter.add(_READS[func])
        if func in _FACTORIES and args and isinstance(args[0], (list, tuple)):
            inner = [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]
            for t in inner:
                if t not in host:
                    self.counter.add(f"{func.__name__}-of-tensors")
        out = func(*args, **kwargs)
        if func in _MOVES and args and isinstance(args[0], torch.Tensor):
            if func is torch.Tensor.to and not _has_device(args[1:], kwargs):
                return _tag_like(out, args[0] in host, host)  # a dtype change keeps the tensor where it is
            if out is args[0] and out in host:
                out = out.view(out.shape)  # the device copy (on a CPU the same tensor): a fresh, untagged alias
            return out
        factory_on_host = not tensors and "device" not in kwargs
        if (tensors and all_host) or factory_on_host or self.counter.on_host:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    host[t] = True
        return out


def _has_device(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) for a in args[:1])


def _tag_like(out, is_host: bool, host) -> torch.Tensor:
    if is_host and isinstance(out, torch.Tensor):
        host[out] = True
    return out


def _scalar_fill(func, indices, args) -> bool:
    """``x[mask] = 0``: torch's index_put runs a one-mask write of a single host value as ``masked_fill_``, which
    needs no sync (a 0-dim value is taken for the Python number that such a write makes)."""
    value = args[2] if len(args) > 2 else None
    return (func is not _aten.index.Tensor and len(indices) == 1 and isinstance(value, torch.Tensor)
            and value.dim() == 0)


class _Ops(TorchDispatchMode):
    """Counts the dispatcher ops that sync, on tensors that are not tagged host."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        host = self.counter.host
        name = None
        if func in _SYNC_OPS:
            name = _SYNC_OPS[func]
            subject = args[0] if args else None
        elif func in _BOOL_INDEX:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            masks = [i for i in indices or () if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
            name = _BOOL_INDEX[func] if masks and not _scalar_fill(func, indices, args) else None
            subject = masks[0] if masks else None
        elif func in _REPEAT and kwargs.get("output_size") is None:
            name, subject = "repeat_interleave", args[0] if args else None
        if name and isinstance(subject, torch.Tensor) and subject not in host and not self.counter.on_host:
            self.counter.add(name)
        return func(*args, **kwargs)


class SyncCounter:
    """``with SyncCounter(host=[...]) as c:`` counts the syncing calls in the block (see the module docstring);
    ``host``: tensors that are on the host (e.g. every tensor of the step's host batches); ``host_functions``:
    ``(owner, name)`` of functions that take host tensors only and so make host tensors only (on a CPU run a factory
    call's ``device=t.device`` cannot say whether ``t`` would be on the GPU), e.g. the model's host layout."""

    def __init__(self, host=(), host_functions=()):
        self.host = WeakIdKeyDictionary()
        self.on_host = 0  # inside a host function
        self._functions = [(owner, name, getattr(owner, name)) for owner, name in host_functions]
        for t in host:
            if isinstance(t, torch.Tensor):
                self.host[t] = True
        self.sites: collections.Counter = collections.Counter()
        self._modes = (_Tags(self), _Ops(self))

    def add(self, kind: str) -> None:
        self.sites[(kind, caller())] += 1

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def by_site(self) -> dict[str, int]:
        """``"kind at path:line function"`` -> count, most frequent first."""
        return {f"{k} at {s}": n for (k, s), n in self.sites.most_common()}

    def __enter__(self):
        # RNG states are host tensors on a GPU too (megatron's RNG tracker compares the CPU generator's)
        self._rng = {(torch, "get_rng_state"): torch.get_rng_state,
                     (torch.cuda, "get_rng_state"): torch.cuda.get_rng_state}
        for torch_seen in _torch_copies():  # the CPU layer's step modules read a copy of torch (cpu-step-factories)
            self._rng[(torch_seen, "get_rng_state")] = torch_seen.get_rng_state
        for (owner, name), f in self._rng.items():
            setattr(owner, name, self._on_host(f))
        for owner, name, f in self._functions:
            setattr(owner, name, self._host_function(f))
        self._modes[0].__enter__()
        self._modes[1].__enter__()
        return self

    def __exit__(self, *exc):
        self._modes[1].__exit__(*exc)
        self._modes[0].__exit__(*exc)
        for (owner, name), f in self._rng.items():
            setattr(owner, name, f)
        for owner, name, f in self._functions:
            setattr(owner, name, f)
        return False

    def _host_function(self, f):
        def g(*args, **kwargs):
            self.on_host += 1
            try:
                return f(*args, **kwargs)
            finally:
                self.on_host -= 1
        return g

    def _on_host(self, f):
        def g(*args, **kwargs):
            out = f(*args, **kwargs)
            self.host[out] = True
            return out
        return g


def batch_tensors(batches, skip=()) -> list:
    """Every tensor field of ``batches`` (dataclass batches; None for a middle stage's) but the fields ``skip``."""
    import dataclasses

    out = []
    for b in batches:
        if b is not None and dataclasses.is_dataclass(b):
            out += [getattr(b, f.name) for f in dataclasses.fields(b)
                    if f.name not in skip and isinstance(getattr(b, f.name, None), torch.Tensor)]
    return out


def optimizer_host_state(optimizer) -> list:
    """The ``step`` counters of the torch optimizers inside a megatron-core optimizer: torch keeps them on the host
    unless the optimizer is ``capturable`` or ``fused``, so reading them (Adam's bias correction) is no sync."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    out.append(step)
    return out


class CudaSyncCounter:
    """On a GPU: ``torch.cuda.set_sync_debug_mode("warn")`` for the block, each synchronising call's warning counted
    by its caller (``by_site``, ``total`` as :class:`SyncCounter`)."""

    def __init__(self):
        self.sites: collections.Counter = collections.Counter()

    def __enter__(self):
        self._previous = torch.cuda.get_sync_debug_mode()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        sites, show = self.sites, warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                sites[("cuda-sync", caller())] += 1
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self._previous)
        self._catch.__exit__(*exc)  # restores warnings.showwarning too
        return False

    total = SyncCounter.total
    by_site = SyncCounter.by_site


def main(argv=None) -> None:
    """``python -m tests.support.sync_count WORK_DIR [WORLD]``: one steady training step of the trainer's step
    (tests/support/train_jobs.py, CPU) of tiny LLaVAs with 2 and 4 language layers, at micro batch 4 and 2 of a
    global batch of 8 (2 and 4 micro batches), its host syncs by caller; WORLD ranks at data parallelism."""
    import argparse
    from pathlib import Path

    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from megatron_vlm.runtime.spawn import run_world
    from tests.support.tiny import make_tiny_llava
    from tests.support.train_jobs import train_jobs, variable_length_batches

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("work_dir", type=Path, help="where the tiny models are made (kept for the next run)")
    parser.add_argument("world", type=int, nargs="?", default=1, help="ranks (data parallelism)")
    args = parser.parse_args(argv)
    layers = (2, 4)
    for n in layers:
        hf, meg = args.work_dir / f"hf{n}", args.work_dir / f"meg{n}"
        if not hf.exists():
            make_tiny_llava(hf, "llama", "clip", text_overrides={"num_hidden_layers": n})
        if not meg.exists():
            convert_hf_to_megatron(hf, meg, tp=1)
    batches = {n: variable_length_batches(args.work_dir / f"hf{n}", 2) for n in layers}
    jobs = [dict(name=f"{n} layers, micro batch {m}", micro_batch_size=m, megatron_dir=str(args.work_dir / f"meg{n}"),
                 hf_dir=str(args.work_dir / f"hf{n}"), batches=n, count_step_syncs=True)
            for n in layers for m in (4, 2)]
    for result in run_world(train_jobs, args.world, jobs, None, None, batches)[0]:
        print(f"== {result['name']}: loss {result['loss']}")
        for rank, sites in enumerate(result["step_syncs"]):
            print(f"  rank {rank}: {sum(sites.values())} syncs")
            for site, n in sites.items():
                print(f"    {n:4d} {site}")


if __name__ == "__main__":
    main()


def _torch_copies() -> list:
    """The stand-ins for the ``torch`` module that modules hold instead of torch itself (the CPU layer gives the
    megatron-core modules of a training step a copy whose factories make CPU tensors: runtime/cpu_compat.py)."""
    import sys
    import types

    seen = {}
    for module in list(sys.modules.values()):
        t = getattr(module, "torch", None) if isinstance(module, types.ModuleType) else None
        if isinstance(t, types.ModuleType) and t is not torch and t.__name__ == "torch":
            seen[id(t)] = t
    return list(seen.values())
