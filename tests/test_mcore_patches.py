"""The registry of every change megatron-vlm makes to megatron-core (megatron_vlm/runtime/mcore_patches.py, issue 62):
every entry is complete and names a test that exists; applying an entry changes exactly the attributes it declares,
and its undo gives back the identical original objects (deleting what did not exist); a megatron-core release an entry
was not checked against is refused in one line; the mechanism's own rules (conflicts, scopes, outside changes); the
audit that finds a change no entry holds; and the distributed optimizer's saved state checked by what megatron-core
returns (each parameter's own values), not by its source. The world-wide audit (the CPU layer, builds, CP, packing,
forward and backward in one world: every change to megatron-core is an active entry's) runs in
tests/test_packing_equivalence.py's world."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch

from megatron_vlm.runtime import mcore_patches
from megatron_vlm.runtime.mcore_patches import MISSING, PATCHES
from tests.conftest import not_here

ROOT = Path(__file__).resolve().parent.parent
OWNERS = sorted({p.owner for p in PATCHES})


@pytest.fixture(scope="module", autouse=True)
def owners():
    """Every owner imported (each registers its implementations), and the CPU layer of this CPU process on."""
    for owner in OWNERS:
        importlib.import_module(owner)
    if not torch.cuda.is_available():
        from megatron_vlm.runtime import cpu_compat

        cpu_compat.enable()


def _test_exists(test_id: str) -> bool:
    path, _, name = test_id.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_entry_is_complete_and_names_a_test_that_exists():
    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    for p in PATCHES:
        assert p.replaces and p.reason and p.when and p.undo, p.name
        assert p.scope.startswith(("process:", "around ")), (p.name, p.scope)
        assert set(p.versions) <= {"0.16", "0.19"} and p.versions, (p.name, p.versions)  # the two lanes
        assert _test_exists(p.test), f"{p.name}: its test {p.test} does not exist"
        assert mcore_patches._IMPLEMENTATIONS.get(p.name) is not None, f"{p.owner} does not implement {p.name}"
    held = [t for p in PATCHES for t in p.replaces]
    assert len(held) == len(set(held)), "two entries replace one attribute"
    doc = (ROOT / "docs" / "development.md").read_text()
    section = doc[doc.index("## The megatron-core patch registry"):]
    section = section[:section.index("\n## ", 3)]
    assert not [n for n in names if f"`{n}`" not in section], "docs/development.md's registry section misses entries"


#: what an entry's implementation takes (the rest take nothing)
PARAMS = {"llava-local-core-attention": lambda: {"core_attention": _dot_product_attention()}}


def _dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def _differences(before: dict, after: dict) -> set[str]:
    """Every key of ``before`` (an attribute that existed, with its module or class) whose value changed, whatever
    its kind; and new attributes of modules and classes that existed."""
    out = {k for k in before if not mcore_patches._same(before[k], after.get(k, MISSING))}
    return out | {k for k in after.keys() - before.keys()
                  if mcore_patches._container(k) in before and not isinstance(after[k], type(sys))}


@pytest.mark.parametrize("name", [pytest.param(p.name, marks=[pytest.mark.te] if p.name == "cpu-te-construction"
                                               else []) for p in PATCHES])
def test_each_entry_changes_exactly_its_attributes_and_undoes_to_the_originals(name):
    """Applied through the registry, the entry changes its declared targets and nothing else of megatron-core's
    modules and classes (torch.cuda, the mode stack, sys.modules); its undo gives every target back the identical
    object it had (an attribute that did not exist is deleted). A process-wide entry of this CPU process (the CPU
    layer) is undone first, checked the same way, and re-applied. Under a megatron-core its entry was not checked
    against (megatron-core 0.19 for an 0.16-only entry), it is refused and changes nothing."""
    entry = mcore_patches.get(name)
    params = PARAMS.get(name, dict)()
    if mcore_patches.megatron_core_version() not in entry.versions:
        before = mcore_patches.snapshot()
        with pytest.raises(mcore_patches.UnauditedVersion, match=f"not audited for megatron-vlm's patch '{name}'"):
            with mcore_patches.applied(name, **params):
                pass
        assert not _differences(before, mcore_patches.snapshot())
        return
    lasting = mcore_patches.is_active(name)
    if lasting:
        originals = mcore_patches.originals(name)
        mcore_patches.undo(name)
        assert all(mcore_patches._same(mcore_patches.read(t), v) for t, v in originals.items()), name
    try:
        targets = set(mcore_patches.targets(name))
        before = mcore_patches.snapshot()
        firsts = {t: mcore_patches.read(t) for t in targets}
        with mcore_patches.applied(name, **params):
            assert mcore_patches.active()[-1] == name
            during = mcore_patches.snapshot()
            changed = {k for k in _differences(before, during) if not mcore_patches.covered(k, targets)}
            assert not changed, f"{name} changed what its entry does not declare: {sorted(changed)}"
            for t in targets:
                now = mcore_patches.read(t)
                value = mcore_patches._ACTIVE[name].values[t]
                assert (now[-1] is value) if t == mcore_patches.MODE_STACK else now is value, t
        assert not mcore_patches.is_active(name)
        assert all(mcore_patches._same(mcore_patches.read(t), firsts[t]) for t in targets), name
        assert not _differences(before, mcore_patches.snapshot()), name
    finally:
        if lasting:
            mcore_patches.apply(name, **params)


def test_an_unaudited_megatron_core_is_refused_in_one_line(monkeypatch):
    """An upgrade (say to 0.20) fails at the registry, once per entry used, in one line that names the entry, what it
    replaces, its test and where to audit it; nothing is changed, and active entries are refused alike."""
    monkeypatch.setattr(mcore_patches, "megatron_core_version", lambda: "0.20")
    before = mcore_patches.snapshot()
    for p in PATCHES:
        for use in (lambda: mcore_patches.apply(p.name), lambda: mcore_patches.applied(p.name).__enter__()):
            with pytest.raises(mcore_patches.UnauditedVersion) as e:
                use()
            message = str(e.value)
            assert "\n" not in message and message.startswith("megatron-core 0.20 is not audited"), message
            assert p.name in message and p.test in message and "megatron_vlm/runtime/mcore_patches.py" in message
    assert not _differences(before, mcore_patches.snapshot())


# ---- the mechanism, on a module of this test ----------------------------------------------------------------------
PROBE = "tests.test_mcore_patches"
probe_value = "the original"


@pytest.fixture
def probe_entry(monkeypatch):
    """A registry entry ``probe`` replacing this module's ``probe_value`` and ``probe_new`` (which does not exist)."""
    entry = mcore_patches.Patch("probe", (f"{PROBE}:probe_value", f"{PROBE}:probe_new"), "a test", ("0.16", "0.19"),
                                "tests", "around a test", "the scope's end", "tests/test_mcore_patches.py::x", PROBE)
    monkeypatch.setitem(mcore_patches.BY_NAME, "probe", entry)
    monkeypatch.setitem(mcore_patches._IMPLEMENTATIONS, "probe", lambda originals, value="patched": {
        f"{PROBE}:probe_value": value, f"{PROBE}:probe_new": len(originals)})
    yield entry
    mcore_patches.undo("probe")


def test_scopes_nest_and_undo_deletes_what_did_not_exist(probe_entry):
    module = sys.modules[PROBE]
    original = module.probe_value
    with mcore_patches.applied("probe"):
        assert module.probe_value == "patched" and module.probe_new == 2
        with mcore_patches.applied("probe"):  # nested: one install, undone by the outer scope's end
            pass
        assert mcore_patches.is_active("probe")
        with pytest.raises(mcore_patches.PatchError, match="is active with"):  # other parameters while active
            with mcore_patches.applied("probe", value="other"):
                pass
    assert module.probe_value is original and not hasattr(module, "probe_new") and "probe" not in \
        mcore_patches.active()
    mcore_patches.apply("probe")  # for the process: a scope inside it leaves it on
    with mcore_patches.applied("probe"):
        pass
    assert mcore_patches.is_active("probe")
    mcore_patches.undo("probe")
    assert module.probe_value is original and not hasattr(module, "probe_new")


def test_what_an_implementation_changes_must_be_what_its_entry_declares(probe_entry, monkeypatch):
    monkeypatch.setitem(mcore_patches._IMPLEMENTATIONS, "probe", lambda originals: {f"{PROBE}:probe_value": 1,
                                                                                    f"{PROBE}:elsewhere": 2})
    with pytest.raises(mcore_patches.PatchError, match=r"changes \['tests.test_mcore_patches:elsewhere'\] and "
                                                       r"leaves \['tests.test_mcore_patches:probe_new'\]"):
        mcore_patches.apply("probe")
    assert probe_value == "the original" and not mcore_patches.is_active("probe")


def test_two_entries_never_hold_one_attribute_and_outside_changes_are_caught(probe_entry, monkeypatch):
    twin = mcore_patches.Patch("twin", (f"{PROBE}:probe_value",), "a test", ("0.16", "0.19"), "tests",
                               "around a test", "the scope's end", "tests/test_mcore_patches.py::x", PROBE)
    monkeypatch.setitem(mcore_patches.BY_NAME, "twin", twin)
    monkeypatch.setitem(mcore_patches._IMPLEMENTATIONS, "twin", lambda originals: {f"{PROBE}:probe_value": 3})
    module = sys.modules[PROBE]
    with mcore_patches.applied("probe"):
        with pytest.raises(mcore_patches.PatchError, match="which patch 'probe' holds"):
            mcore_patches.apply("twin")
        monkeypatch.setattr(module, "probe_value", "changed behind the registry's back")
        with pytest.raises(mcore_patches.PatchError, match="was replaced outside the registry"):
            mcore_patches.undo("probe")


def test_the_audit_finds_a_change_no_entry_holds():
    """:func:`unregistered` reports a function of megatron-core replaced outside the registry (the negative control of
    the world-wide audit), and nothing for megatron-core's own state or an active entry's targets."""
    from megatron.core.models.multimodal import llava_model

    before = mcore_patches.snapshot()
    real = llava_model.LLaVAModel.forward
    llava_model.LLaVAModel.forward = lambda self, *a, **k: real(self, *a, **k)
    try:
        assert mcore_patches.unregistered(before) == [
            "megatron.core.models.multimodal.llava_model:LLaVAModel.forward"]
    finally:
        llava_model.LLaVAModel.forward = real
    assert mcore_patches.unregistered(before) == []
    with mcore_patches.applied("cp-te-version-checks"):
        assert mcore_patches.unregistered(before) == []


# ---- the distributed optimizer's saved state (training/checkpointing.py) -----------------------------------------
def _place(sharded, key: str) -> tuple:
    """A parameter's place among a model's sharded tensors: megatron-core names a block's layers with one key and
    tells them apart by their offset (factories, e.g. SwiGLU's: by their build function)."""
    return key, getattr(sharded, "global_offset", None), getattr(sharded, "build_fn", None)


def _own(optimizer, model_sd) -> dict:
    """megatron-core's optimizer's own state of every parameter, by (state name, place): one process, so this rank
    holds all of it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    out = {}
    for sh in nested_values(extract_sharded_tensors_and_factories(model_sd)[0]):
        if sh.data.requires_grad:
            for name, values in optimizer._get_main_param_and_optimizer_states(sh.data).items():
                if name != "step":  # megatron-core saves the step from its parameter groups
                    out[name, _place(sh, sh.key)] = values.detach().reshape(-1).float()
    return out


def _wrong(saved: dict, optimizer, model_sd) -> list:
    """The (state name, place) whose saved tensor (made for the model's sharded state dict ``model_sd``) is not the
    parameter's own values."""
    own = _own(optimizer, model_sd)
    got = {(name, _place(t, t.key[len(f"optimizer.state.{name}."):])): t.data.reshape(-1)
           for state in saved.values() for name, t in state.items()}
    assert own.keys() == got.keys()
    return [k for k in own if not torch.equal(got[k], own[k])]


def _as_a_fixed_release(original):
    """megatron-core's ``sharded_param_state_fully_reshardable`` as a release with NVIDIA/Megatron-LM#5077 behaves:
    every parameter read at its own place (here: megatron-core's own function handed the gathered tensors at the
    buffer's offsets). Its text still says 'param range exceeds' (say, in the message of the fix's bound check): a
    detection by source text takes it for the broken one."""

    def fixed(self, *args, **kwargs):
        """param range exceeds unpadded buffer: an explicit bound check (the stand-in's docstring)"""
        gather = self.get_parameter_state_dp_zero

        def at_offsets(*a, **k):
            state = gather(*a, **k)
            for index, buffer in enumerate(self.buffers):
                buckets = buffer.buckets
                size = buckets[-1].offset + buckets[-1].grad_data.numel()
                for world in state[index].values():
                    for key, packed in list(world.items()):
                        if torch.is_tensor(packed) and packed.dim() == 1 and len(buckets) > 1:
                            out, at = packed.new_zeros(size), 0
                            for b in buckets:
                                out[b.offset:b.offset + b.numel_unpadded] = packed[at:at + b.numel_unpadded]
                                at += b.numel_unpadded
                            world[key] = out
            return state

        prior = vars(self).get("get_parameter_state_dp_zero")  # an instance's own, as a wrapper may have set
        self.get_parameter_state_dp_zero = at_offsets
        try:
            return original(self, *args, **kwargs)
        finally:
            if prior is None:
                del self.get_parameter_state_dp_zero
            else:
                self.get_parameter_state_dp_zero = prior

    return fixed


def test_optimizer_state_is_each_parameters_own_whatever_megatron_core_returns(hf_models, monkeypatch):
    """A one-process world, the distributed optimizer over several DDP buckets (--overlap-grad-reduce, a small
    --ddp-bucket-size), one Adam step on random gradients; the trainer's save state (checkpointing._state_dict):

    - megatron-core 0.16 / 0.19 as installed: its own 'fully_reshardable' state gives parameters past the first
      bucket another's values (the control, outside the registry's scope); the save gives every tensor the
      parameter's own values (those megatron-core's optimizer holds);
    - a release with the upstream fix (a stand-in whose source still says 'param range exceeds'): recognised by what
      it returns and left as it is (the source-text detection corrupted it: relaid twice);
    - nothing of the registry is left active after either save."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_vlm.model.spec import VLMSpec
    from megatron_vlm.runtime.session import single_process_world
    from megatron_vlm.training import checkpointing
    from megatron_vlm.training.build import build_training, release
    from megatron_vlm.training.config import TrainConfig
    from tests.support.train_jobs import BASE

    if torch.cuda.is_available():
        not_here("the one-process world here is a CPU one")
    original = DistributedOptimizer.__dict__["sharded_param_state_fully_reshardable"]  # megatron-core's own
    spec = VLMSpec.from_hf_dir(hf_models["llama_clip"])
    cfg = TrainConfig(**{**BASE, "train_iters": 1, "global_batch_size": 1, "micro_batch_size": 1, "dist_optim": True,
                         "overlap_grad_reduce": True, "ddp_bucket_size": 4000})
    with single_process_world("cpu"):
        training = build_training(cfg, spec)
        try:
            assert len(training.ddps[0].buffers[0].buckets) > 2  # several buckets, each padded at its end
            g = torch.Generator().manual_seed(0)
            for p in training.models[0].parameters():
                if p.requires_grad:
                    p.main_grad.copy_(torch.randn(p.shape, generator=g))
            training.optimizer.step()
            optimizer = training.optimizer.chained_optimizers[0] if hasattr(training.optimizer, "chained_optimizers") \
                else training.optimizer
            def megatron_cores():
                model_sd = checkpointing.ckpt.model_sharded_state_dict(training.models[0],
                                                                       checkpointing.ckpt.DistKeyLayout())
                saved = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=checkpointing.OPTIM_METADATA)
                return _wrong(saved["param_state"], optimizer, model_sd)

            def the_trainers():
                sd = checkpointing._state_dict(training.models, training.optimizer, None, 1, None, with_optim=True,
                                               loading=False, with_rng=False, with_data=False)
                return _wrong(sd["optimizer"]["param_state"], optimizer, sd["model"])

            wrong = megatron_cores()
            if not wrong:
                not_here("this megatron-core saves every parameter's own state (NVIDIA/Megatron-LM#5077)")
            print(f"\nmegatron-core's own save: {len(wrong)} state tensors wrong")
            assert the_trainers() == []
            assert checkpointing.OWN_STATE not in mcore_patches.active()
            fixed = _as_a_fixed_release(original)
            monkeypatch.setattr(DistributedOptimizer, "sharded_param_state_fully_reshardable", fixed)
            assert megatron_cores() == []  # the stand-in is right by itself
            assert the_trainers() == []
            assert DistributedOptimizer.sharded_param_state_fully_reshardable is fixed
            assert checkpointing.OWN_STATE not in mcore_patches.active()
        finally:
            release(training)


def test_foreach_optimizer_kernels_equal_megatron_cores_fallbacks():
    """Entry foreach-optimizer-kernels (runtime/optimizer_kernels.py): megatron-core's get_grad_norm_fp32 (a
    one-process world) gives the same grad norm through the foreach kernels as through megatron-core's own local
    fallback (fp32, relative 1e-6: the per-tensor norms are summed in another order), and a norm that leaves one
    tensor out is told apart; the clip (in place) and the main-parameter copy (fp32 -> bf16, scale 1) equal the
    fallback's bit for bit."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from megatron_vlm.runtime import optimizer_kernels
    from megatron_vlm.runtime.session import single_process_world

    if torch.cuda.is_available():
        not_here("the one-process world here is a CPU one")
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (1,), (300, 7), (5, 5, 5)] * 12
    grads = [torch.randn(s, generator=g) * 10 ** float(torch.randint(-3, 3, (1,), generator=g)) for s in shapes]
    assert mcore_patches.is_active("foreach-optimizer-kernels")  # the CPU layer of this process applies it
    with single_process_world("cpu"):
        ours = clip_grads.get_grad_norm_fp32(grads)
        largest = max(range(len(grads)), key=lambda i: float(grads[i].norm()))
        dropped = clip_grads.get_grad_norm_fp32(grads[:largest] + grads[largest + 1:])
        prior = clip_grads.l2_norm_impl
        clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
        try:
            reference = clip_grads.get_grad_norm_fp32(grads)
        finally:
            clip_grads.l2_norm_impl = prior
    assert abs(ours - reference) <= 1e-6 * reference, (ours, reference)
    assert abs(dropped - reference) > 1e-6 * reference  # the check tells a wrong norm apart
    buf = torch.zeros(1, dtype=torch.int)
    a, b = [t.clone() for t in grads], [t.clone() for t in grads]
    local_multi_tensor_scale(0, buf, [a, a], 0.37)
    optimizer_kernels.scale(0, buf, [b, b], 0.37)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    to_a, to_b = [torch.empty_like(t, dtype=torch.bfloat16) for t in grads], [torch.empty_like(t, dtype=torch.bfloat16)
                                                                             for t in grads]
    local_multi_tensor_scale(0, buf, [grads, to_a], 1.0)
    optimizer_kernels.scale(0, buf, [grads, to_b], 1.0)
    assert all(torch.equal(x, y) for x, y in zip(to_a, to_b))
    scaled_a, scaled_b = [torch.empty_like(t) for t in grads], [torch.empty_like(t) for t in grads]
    local_multi_tensor_scale(0, buf, [grads, scaled_a], 0.5)
    optimizer_kernels.scale(0, buf, [grads, scaled_b], 0.5)
    assert all(torch.equal(x, y) for x, y in zip(scaled_a, scaled_b))
