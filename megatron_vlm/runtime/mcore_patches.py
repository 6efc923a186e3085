"""The one registry of every change megatron-vlm makes to megatron-core (and to what megatron-core sees of torch, of
Transformer Engine and of its own imports), and the one mechanism that makes and undoes them.

Each change is an entry of :data:`PATCHES`, pure data: its name, the exact attributes it replaces, why, the
megatron-core releases it was checked against, when it applies, its scope, how it is undone and the test that shows
it is needed and right. Its code stays with the part that owns it (the entry's ``owner``: the CPU layer in
:mod:`.cpu_compat`, context parallelism in ``model/cp_attention.py``, ...), which registers it with
:func:`implements` and installs it only through this module:

- :func:`applied` (a context manager: for the time of a build, a forward, a routing call, a save) or :func:`apply`
  (for the rest of the process: the CPU layer of a CPU process, what megatron-core's import sees);
- the registry first checks the installed megatron-core against the entry's releases (another one raises
  :class:`UnauditedVersion`: one line naming the entry, its test and where to audit it, so that an upgrade fails
  loudly here and nowhere else), then that the implementation changes exactly the entry's attributes and that no
  other active entry holds one of them; it records every original (an attribute that did not exist included) and
  :func:`undo` restores them exactly (deleting what did not exist);
- :func:`active` lists what is installed; :func:`snapshot` and :func:`unregistered` let a test require that every
  change to megatron-core's modules and classes is an active entry's.

Targets, as entries name them: ``"package.module:Name.attr"`` (an attribute of a module, of a class -- read from
the class's own ``__dict__``, so an inherited attribute counts as missing and its undo deletes the class's own -- or
of a function, e.g. ``__defaults__``); ``"sys.modules:name"`` (an entry of ``sys.modules``);
``"package.module:<autograd Functions>.backward"`` (the ``backward`` of every ``torch.autograd.Function`` subclass
that module defines itself); :data:`MODE_STACK` (torch's function-mode stack of this thread: the implementation's
value is a mode, pushed on apply and popped on undo).

Left out on purpose: changes to one object megatron-vlm built (a router's ``routing`` wrapped by
``training/moe/orchestration.py``, a model's loss function by ``training/objective.py``,
``_language_is_pipeline_parallel`` of a model) live and die with that object, and resetting megatron-core's state
(``runtime/distributed.py`` forgetting process groups and caches) replaces nothing of its code. How to audit a
megatron-core upgrade: docs/development.md#the-megatron-core-patch-registry.

Pure Python at import (no torch, no megatron-core): ``runtime/lean_imports.py`` uses it before megatron-core is
imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import threading
import types

from megatron_vlm.runtime import mcore_version


class _Missing:
    """An attribute (or ``sys.modules`` entry) that does not exist."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()
#: the target naming torch's function-mode stack (this thread's)
MODE_STACK = "torch:<function mode stack>"
#: the class part of a target that means every ``torch.autograd.Function`` subclass its module defines
FUNCTIONS = "<autograd Functions>"
DOC = "docs/development.md#the-megatron-core-patch-registry"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to megatron-core (see the module docstring)."""

    name: str
    replaces: tuple[str, ...]  # the exact targets it changes
    reason: str  # why megatron-vlm needs it
    versions: tuple[str, ...]  # the megatron-core releases (major.minor) it was checked against
    when: str  # when it is applied
    scope: str  # "process: ..." (until the process ends, or undo) or "around ...": for the time of a call
    undo: str  # how it is undone
    test: str  # the test that shows it is needed and right (tests/...py::test_name)
    owner: str  # the module that implements it and installs it through this registry

    @property
    def process_wide(self) -> bool:
        return self.scope.startswith("process")


_LLAVA = "megatron.core.models.multimodal.llava_model"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_CPU = "megatron_vlm.runtime.cpu_compat"
_CPU_PROCESS = ("process: a CPU process (runtime/distributed.py's setup on CPU, cpu_compat.enable); megatron-core's "
                "CUDA calls are everywhere a CPU rank runs (build, forward, backward, optimizer, checkpoints), so the "
                "layer stays for the process")
_CPU_UNDO = "cpu_compat.disable() (or undo(name)): the registry restores the recorded originals"
_BOTH = ("0.16", "0.19")
#: megatron-core modules whose autograd Functions allocate on the CUDA device in their backward
BACKWARD_MODULES = ("megatron.core.tensor_parallel.random", "megatron.core.tensor_parallel.layers",
                    "megatron.core.tensor_parallel.mappings", _MOE_UTILS, _DISPATCHER)

#: megatron-core modules that make tensors on the CUDA device in a training step (their factory calls name
#: device="cuda" or torch.cuda.current_device()): the schedules' token counts, the pipeline's receive buffers, the
#: tensor- and sequence-parallel gathers and reduce-scatters, the global memory buffer, the causal mask, the grad
#: norm and clip, rotary embeddings under context parallelism, the MoE router, dispatcher and experts, 0.19's
#: LLaVA sound embeddings and grad-norm groups, the optimizers' flags and the grad buffers
STEP_MODULES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
                "megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
                "megatron.core.tensor_parallel.random", "megatron.core.utils", "megatron.core.transformer.utils",
                "megatron.core.optimizer.clip_grads", "megatron.core.models.common.embeddings.rope_utils",
                "megatron.core.models.common.embeddings.rotary_pos_embedding",
                "megatron.core.transformer.moe.router", "megatron.core.transformer.moe.moe_utils",
                "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.experts",
                "megatron.core.transformer.moe.moe_layer", "megatron.core.models.multimodal.llava_model",
                "megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
                "megatron.core.optimizer.grad_scaler", "megatron.core.distributed.finalize_model_grads",
                "megatron.core.distributed.param_and_grad_buffer")
#: megatron-core functions of a training step that move tensors with Tensor.cuda() / .to(<cuda>) or check
#: Tensor.type() or make tensors with a Tensor method (new_empty): they run under the device mode in
#: cpu_compat.step_scope (few ops each)
STEP_MODE_FUNCTIONS = (
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",  # asserts grad.type() is a CUDA type
    "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",  # the name optimizer.py imports
    "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb",  # inv_freq.to(cuda)
    "megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank",  # pinned index .cuda()
    "megatron.core.models.common.embeddings.rotary_pos_embedding:get_pos_emb_on_this_cp_rank",  # its import
    "megatron.core.transformer.moe.router:Router.gating",  # weight.data.to(cuda)
    "megatron.core.tensor_parallel.mappings:_AllToAll.forward")  # MoE's uneven all-to-all: input.new_empty(cuda)

PATCHES: tuple[Patch, ...] = (
    # ---- what megatron-core's import sees (runtime/lean_imports.py) -----------------------------------------------
    Patch("lean-import-transformer-engine", ("sys.modules:transformer_engine",),
          "megatron-core imports Transformer Engine eagerly behind try/except ImportError fallbacks; a CPU rank cannot "
          "use it (~0.6 CPU-s per rank in the 3.12 lane): None in sys.modules makes megatron-core take its own no-TE "
          "path", _BOTH, "a CPU rank (train/pretrain_vlm.py), before megatron-core is imported",
          "process: megatron-core's import-time choice stays for the process",
          "undo(name) removes the marker (megatron-core keeps the choice its import made)",
          "tests/test_lean_imports.py::test_marked_libraries_fail_to_import_as_if_not_installed",
          "megatron_vlm.runtime.lean_imports"),
    Patch("lean-import-wandb", ("sys.modules:wandb",),
          "megatron-core's timers import wandb eagerly behind try/except ImportError; a run without --wandb (and the "
          "converters) never log to it (~0.3 CPU-s per process)", _BOTH,
          "a rank without --wandb, a converter; before megatron-core is imported",
          "process: megatron-core's import-time choice stays for the process",
          "undo(name) removes the marker (megatron-core keeps the choice its import made)",
          "tests/test_lean_imports.py::test_a_converter_marks_wandb_alone", "megatron_vlm.runtime.lean_imports"),
    # ---- the CPU compatibility layer (runtime/cpu_compat.py) ------------------------------------------------------
    Patch("cpu-cuda-stand-ins", tuple(f"torch.cuda:{n}" for n in ("current_device", "synchronize", "current_stream",
                                                                 "get_rng_state", "set_rng_state", "manual_seed")),
          "megatron-core calls torch.cuda's device, stream and RNG functions; CPU stand-ins (the 'CUDA' RNG state is "
          "the CPU generator's, so megatron's RNG tracker forks the generator CPU ops use)", _BOTH,
          "no CUDA device (cpu_compat.enable)", _CPU_PROCESS, _CPU_UNDO,
          "tests/test_cpu_compat.py::test_rng_tracker_forks_the_cpu_generator", _CPU),
    Patch("cpu-megatron-rng-state", ("megatron.core.tensor_parallel.random:_get_cuda_rng_state",
                                     "megatron.core.tensor_parallel.random:_set_cuda_rng_state"),
          "megatron's RNG tracker reads and sets CUDA generators through these; on CPU: the CPU generator's state",
          _BOTH, "no CUDA device (cpu_compat.enable)", _CPU_PROCESS, _CPU_UNDO,
          "tests/test_cpu_compat.py::test_rng_tracker_forks_the_cpu_generator", _CPU),
    Patch("cpu-optimizer-kernels", (
        "megatron.core.optimizer:Adam", "megatron.core.optimizer:SGD",
        "megatron.core.optimizer:USING_PYTORCH_OPTIMIZER",
        "megatron.core.optimizer.optimizer:multi_tensor_applier",
        "megatron.core.optimizer.clip_grads:multi_tensor_applier",
        "megatron.core.optimizer.clip_grads:multi_tensor_scale_tensor_impl",
        f"{_DIST_OPT}:Adam", f"{_DIST_OPT}:HAVE_APEX_OR_TE", f"{_DIST_OPT}:USING_TE_OPTIMIZER",
        f"{_DIST_OPT}:USING_APEX_OPTIMIZER"),
          "with Transformer Engine installed (the 3.12 lane) megatron-core binds TE's CUDA optimizer kernels at "
          "import (FusedAdam, multi_tensor_*), which fail on CPU tensors: the names get what megatron-core's import "
          "binds without TE and Apex (torch's Adam, megatron.core.utils' local_multi_tensor_applier; the norm and "
          "scale kernels: entry foreach-optimizer-kernels)", _BOTH,
          "no CUDA device (cpu_compat.enable)", _CPU_PROCESS, _CPU_UNDO,
          "tests/test_cpu_compat.py::test_optimizer_names_are_megatron_cores_own_fallbacks", _CPU),
    Patch("foreach-optimizer-kernels", ("megatron.core.optimizer.clip_grads:l2_norm_impl",
                                        "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",
                                        "megatron.core.optimizer.optimizer:multi_tensor_scale_impl"),
          "megatron-core's local fallbacks for the grad norm, clip and main-parameter copies (no TE, no Apex) take "
          "one torch.norm per tensor gathered into a host list: a host sync per parameter tensor every step; torch's "
          "foreach kernels instead (the total stays on the device, get_grad_norm_fp32 reads it once)", _BOTH,
          "a CUDA process whose megatron-core import found neither TE nor Apex (cpu_compat.fix_without_te), and "
          "every CPU process (cpu_compat.enable, where TE's kernels cannot run)",
          "process: every optimizer step of the process", "undo(name) restores megatron-core's bound kernels",
          "tests/test_mcore_patches.py::test_foreach_optimizer_kernels_equal_megatron_cores_fallbacks",
          "megatron_vlm.runtime.optimizer_kernels"),
    Patch("cpu-compiled-eager", ("torch._dynamo.eval_frame:_stance",),
          "megatron-core torch.compile's elementwise functions (its jit_fuser: quick_gelu, bias-GELU/SwiGLU); on CPU "
          "every process would trace and compile them with Inductor at its first forward (~2-3 CPU-s): torch's "
          "force_eager stance (the object torch.compiler.set_stance stores there) runs them eagerly", _BOTH,
          "no CUDA device (cpu_compat.enable)", _CPU_PROCESS, _CPU_UNDO,
          "tests/test_cpu_compat.py::test_megatron_compiled_functions_run_eagerly", _CPU),
    Patch("packed-local-attention",
          ("megatron.core.transformer.dot_product_attention:DotProductAttention.forward",),
          "megatron-core's local DotProductAttention refuses packed_seq_params; with qkv_format 'thd' the patched "
          "forward runs megatron's own attention once per cu_seqlens segment (calls without 'thd' are unchanged)",
          _BOTH, "local layers with packed sequences (data/packing.check_packing_supported), and every CPU process",
          "process: every local attention of the process may be handed packed rows", _CPU_UNDO,
          "tests/test_packing_equivalence.py::test_attention_across_samples_fails_the_check", _CPU),
    Patch("cpu-moe-dispatcher", (f"{_DISPATCHER}:MoEAlltoAllTokenDispatcher.cuda_dtoh_stream",
                                 f"{_MOE_UTILS}:maybe_move_tensor_to_cpu", f"{_DISPATCHER}:maybe_move_tensor_to_cpu"),
          "the all-to-all dispatcher makes a torch.cuda.Stream() for its device-to-host copies and makes numpy split "
          "sizes of CUDA tensors only: the CPU's current stream, and CPU tensors converted alike", _BOTH,
          "no CUDA device (cpu_compat.enable)", _CPU_PROCESS, _CPU_UNDO,
          "tests/test_cpu_compat.py::test_moe_router_and_dispatcher_run_on_cpu", _CPU),
    Patch("moe-router-torch-gemm", (f"{_MOE_UTILS}:te_general_gemm",),
          "the router's gating tests `te_general_gemm is not None`: 0.16 binds the name only when TE imports (a "
          "NameError without TE), and TE's GEMM needs a GPU: None is megatron-core's torch matmul path", _BOTH,
          "no CUDA device (cpu_compat.enable), or Transformer Engine not imported (cpu_compat.fix_without_te)",
          "process: a process without TE (or without CUDA) routes with torch's matmul throughout", _CPU_UNDO,
          "tests/test_cpu_compat.py::test_moe_router_and_dispatcher_run_on_cpu", _CPU),
    Patch("cpu-step-factories", tuple(f"{m}:torch" for m in STEP_MODULES),
          "megatron-core makes tensors on device='cuda' / torch.cuda.current_device() in a training step (schedules, "
          "pipeline receive buffers, TP/SP gathers, the global memory buffer, the causal mask, grad norm and clip, "
          "MoE): their modules' `torch` is torch with factory functions that make CPU tensors, so that the step runs "
          "without the per-op device mode (cpu_compat.step_scope)", _BOTH, "no CUDA device (cpu_compat.enable)",
          _CPU_PROCESS, _CPU_UNDO, "tests/test_cpu_compat.py::test_a_step_runs_without_the_device_mode", _CPU),
    Patch("cpu-step-mode-sites", STEP_MODE_FUNCTIONS,
          "the functions of a training step that move tensors with Tensor.cuda() / .to(cuda) or assert a CUDA "
          "Tensor.type() (clip, rotary embeddings, CP's RoPE indices, the MoE router and its uneven all-to-all) run under the device mode "
          "inside cpu_compat.step_scope (unchanged outside it)", _BOTH, "no CUDA device (cpu_compat.enable)",
          _CPU_PROCESS, _CPU_UNDO, "tests/test_cpu_compat.py::test_a_step_runs_without_the_device_mode", _CPU),
    Patch("cpu-device-mode", (MODE_STACK,),
          "megatron-core hard-codes device='cuda' / torch.cuda.current_device() in factory calls and .cuda(): a "
          "TorchFunctionMode rewrites CUDA devices to the CPU (and pin_memory off, Tensor.cuda() a no-op)", _BOTH,
          "no CUDA device (cpu_compat.enable)", _CPU_PROCESS,
          "cpu_compat.disable() (or undo(name)): the mode is popped (it must be the innermost mode)",
          "tests/test_cpu_compat.py::test_cuda_devices_become_cpu", _CPU),
    Patch("cpu-backward-under-mode", tuple(f"{m}:{FUNCTIONS}.backward" for m in BACKWARD_MODULES),
          "the autograd engine runs a Function's backward outside the thread-local mode: activation recomputation "
          "and the sequence-parallel reduce-scatters allocate on the CUDA device there; their backward runs under "
          "the CPU mode", _BOTH, "no CUDA device (cpu_compat.enable)", _CPU_PROCESS, _CPU_UNDO,
          "tests/test_cpu_compat.py::test_megatron_autograd_backwards_run_under_the_cpu_mode", _CPU),
    Patch("cpu-te-construction", ("torch.cuda:is_available",),
          "TransformerEngineBaseModule.__init__ refuses to run without CUDA; answered True for that one caller, so "
          "that the GPU path's build, checkpoint load and save run in CPU tests (TE's kernels still need a GPU)",
          _BOTH, "Transformer Engine layers built on a machine without CUDA (model/build.py)",
          "around the build of a model with Transformer Engine layers (cpu_compat.te_construction)",
          "the scope's end restores torch.cuda.is_available",
          "tests/test_te.py::test_cpu_shim_answers_only_te_construction", _CPU),
    Patch("cpu-inference", ("megatron.core.inference.communication_utils:_is_cuda",
                            "megatron.core.inference.text_generation_controllers.text_generation_controller:torch"),
          "megatron-core's text-generation controller makes its sampling generator on the CUDA device and times each "
          "step with torch.cuda.Event, and its pipeline broadcasts assert CUDA tensors: a CPU generator and a CPU "
          "timing event in the controller's torch, and the broadcasts' check keeps only 'not None'", _BOTH,
          "generation on the sharded model in a CPU process (eval/sharded.py)",
          "around the construction and every generation call of a sharded generator (cpu_compat.inference_scope)",
          "the scope's end restores both names",
          "tests/test_eval.py::test_sharded_generation_equals_the_export", _CPU),
    # ---- without Transformer Engine and Apex (runtime/cpu_compat.fix_without_te) ----------------------------------
    Patch("clip-norm-without-te", ("megatron.core.models.vision.clip_vit_model:CLIPViTModel.__init__.__defaults__",),
          "without TE CLIPViTModel's ln_pre/ln_post default to torch.nn.LayerNorm, which build_module cannot "
          "construct with a config: megatron-core's WrappedTorchNorm instead", _BOTH,
          "Transformer Engine not imported (the default is torch.nn.LayerNorm)",
          "process: every CLIPViTModel a process without TE builds", "undo(name) restores the defaults tuple",
          "tests/test_cpu_compat.py::test_clip_norm_fallback_builds_without_te", _CPU),
    Patch("torch-adam-state-load", (f"{_DIST_OPT}:DistributedOptimizer._set_main_param_and_optimizer_states",),
          "without Apex/TE the distributed optimizer runs torch's Adam, whose state has a 'step' that 0.16's load "
          "skips on the source side and expects on the destination (KeyError: 'step' on a resume); megatron then "
          "shares one step tensor among all parameters, which torch's Adam increments once per parameter: each gets "
          "its own copy", _BOTH, "every process (a no-op for optimizers whose state has no step)",
          "process: any checkpoint load of the process", "undo(name) restores megatron-core's method",
          "tests/test_train_parallel.py::test_bf16_distributed_optimizer_resume_is_exact", _CPU),
    # ---- context parallelism without Transformer Engine (model/cp_attention.py) -----------------------------------
    Patch("cp-batch-split-import", ("sys.modules:megatron.training", "sys.modules:megatron.training.utils"),
          "megatron-core 0.16's LLaVAModel imports get_batch_on_this_cp_rank from Megatron-LM's "
          "megatron.training.utils, which the megatron-core package does not ship: a module of that name holding "
          "megatron-core's own megatron.core.utils.get_batch_on_this_cp_rank (0.19 imports that one itself)",
          ("0.16",), "context parallelism, where LLaVAModel's compiled code names megatron.training.utils and "
          "Megatron-LM is not installed", "around the build and every forward of a context-parallel LLaVAModel",
          "the scope's end removes both sys.modules entries",
          "tests/test_context_parallel.py::test_llava_model_finds_what_it_imports_for_context_parallelism",
          "megatron_vlm.model.cp_attention"),
    Patch("cp-partition-kernel", (f"{_LLAVA}:tex", f"{_LLAVA}:HAVE_TEX"),
          "LLaVAModel splits packed ('thd') rows over the CP ranks with TE's thd_get_partitioned_indices, a CUDA "
          "kernel: CPU tensors (and a machine without TE) get the same indices from cp_attention", _BOTH,
          "context parallelism where TE's kernel cannot take the tensors (no TE, or no CUDA)",
          "around the build and every forward of a context-parallel LLaVAModel",
          "the scope's end restores both names",
          "tests/test_packing_equivalence.py::test_context_parallel_packs_equal_unpacked_and_cp1",
          "megatron_vlm.model.cp_attention"),
    Patch("cp-te-version-checks", (f"{_LLAVA}:is_te_min_version",),
          "LLaVAModel asserts is_te_min_version('1.10.0') for CP (build) and packed CP (forward); those checks "
          "guard TE's CP attention and partition kernel, neither of which runs without TE (0.16 does not even bind "
          "the name then)", _BOTH, "context parallelism, LLaVAModel's HAVE_TE false",
          "around the build and every forward of a context-parallel LLaVAModel",
          "the scope's end restores the name (deletes it where megatron-core had none)",
          "tests/test_context_parallel.py::test_llava_model_finds_what_it_imports_for_context_parallelism",
          "megatron_vlm.model.cp_attention"),
    # ---- the model build (model/build.py) -------------------------------------------------------------------------
    Patch("llava-local-core-attention", (f"{_LLAVA}:TEDotProductAttention", f"{_LLAVA}:HAVE_TE"),
          "LLaVAModel asserts that the language spec's core attention is TE's under sequence or context "
          "parallelism; megatron's local attention runs under SP (as in its GPT models), and "
          "cp_attention.ContextParallelAttention under CP: the check accepts the spec's local core attention",
          _BOTH, "local layers with sequence or context parallelism",
          "around LLaVAModel's construction (model/build.py)", "the scope's end restores both names",
          "tests/test_packing_equivalence.py::test_context_parallel_packs_equal_unpacked_and_cp1",
          "megatron_vlm.model.build"),
    # ---- training (training/moe/orchestration.py, training/checkpointing.py) ----------------------------------------
    Patch("moe-token-dropping-positions", ("megatron.core.transformer.moe.router:apply_router_token_dropping",),
          "--moe-expert-capacity-factor: megatron-core figures the capacity over every position of the rows; the "
          "trainer's token dropping counts the positions of samples only and routes padding nowhere", _BOTH,
          "a router of an MoE model in training (training/moe/orchestration.MoETraining)",
          "around one routing call of a router (MoETraining's routing wrapper)",
          "the scope's end restores megatron-core's function",
          "tests/test_moe_spec.py::test_a_router_counts_and_balances_the_samples_positions_only",
          "megatron_vlm.training.moe.orchestration"),
    Patch("optimizer-state-own-values", (f"{_DIST_OPT}:DistributedOptimizer.sharded_param_state_fully_reshardable",),
          "the distributed optimizer's 'fully_reshardable' save reads each parameter of a multi-bucket buffer at "
          "offsets counting the buckets' end padding, in tensors that leave it out (NVIDIA/Megatron-LM#5077): "
          "every tensor megatron-core produced is checked against the parameter's own values, and a wrong one "
          "replaced by them", _BOTH, "a save of the distributed optimizer's state",
          "around the optimizer's sharded_state_dict at a save (training/checkpointing.py)",
          "the scope's end restores megatron-core's method",
          "tests/test_mcore_patches.py::test_optimizer_state_is_each_parameters_own_whatever_megatron_core_returns",
          "megatron_vlm.training.checkpointing"),
)

BY_NAME: dict[str, Patch] = {p.name: p for p in PATCHES}


class PatchError(RuntimeError):
    """A patch that cannot be applied or undone as its entry declares."""


class UnauditedVersion(PatchError):
    """The installed megatron-core is not one a patch was checked against."""


@dataclasses.dataclass
class _Record:
    targets: tuple[str, ...]
    originals: dict
    values: dict
    params: dict
    holds: int = 0
    lasting: bool = False


_IMPLEMENTATIONS: dict = {}
_ACTIVE: dict[str, _Record] = {}  # in the order applied
_LOCK = threading.RLock()


def get(name: str) -> Patch:
    try:
        return BY_NAME[name]
    except KeyError:
        raise PatchError(f"no megatron-core patch is registered as {name!r} (megatron_vlm/runtime/mcore_patches.py)")


def megatron_core_version() -> str:
    """The installed megatron-core's release, major.minor (``'0.16'``)."""
    global _RELEASE
    if _RELEASE is None:
        _RELEASE = ".".join(mcore_version.installed().split(".")[:2])
    return _RELEASE


_RELEASE: str | None = None


def check(name: str) -> Patch:
    """The entry ``name``, if the installed megatron-core is one of its releases; else :class:`UnauditedVersion`."""
    entry = get(name)
    version = megatron_core_version()
    if version not in entry.versions:
        raise UnauditedVersion(
            f"megatron-core {version} is not audited for megatron-vlm's patch {name!r} of {', '.join(entry.replaces)} "
            f"(checked against megatron-core {', '.join(entry.versions)}): audit it and its test {entry.test} for "
            f"{version} and add the release to its entry in megatron_vlm/runtime/mcore_patches.py ({DOC})")
    return entry


def implements(name: str):
    """Register the decorated ``factory(originals, **params) -> {target: value}`` as the implementation of entry
    ``name`` (``originals``: each expanded target's current value, :data:`MISSING` where it has none)."""
    entry = get(name)

    def register(factory):
        _IMPLEMENTATIONS[entry.name] = factory
        return factory

    return register


def targets(name: str) -> tuple[str, ...]:
    """The entry's targets, with every :data:`FUNCTIONS` pattern expanded to the classes it names now."""
    out = []
    for target in get(name).replaces:
        where, _, path = target.partition(":")
        if path.startswith(FUNCTIONS + "."):
            import torch

            module, attr = importlib.import_module(where), path[len(FUNCTIONS) + 1:]
            out += [f"{where}:{key}.{attr}" for key, cls in vars(module).items()
                    if isinstance(cls, type) and issubclass(cls, torch.autograd.Function) and cls.__module__ == where
                    and cls.__name__ == key and attr in cls.__dict__]
        else:
            out.append(target)
    return tuple(out)


def _mode_stack() -> tuple:
    import torch

    return tuple(torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack()))


def _resolve(target: str):
    """(kind, owner, key): 'mode'; 'item' of sys.modules; 'attr' of a module, class or function."""
    if target == MODE_STACK:
        return "mode", None, None
    where, _, path = target.partition(":")
    if where == "sys.modules":
        return "item", sys.modules, path
    owner = importlib.import_module(where)
    *chain, attr = path.split(".")
    for part in chain:
        owner = getattr(owner, part)
    return "attr", owner, attr


def read(target: str):
    """``target``'s current value (:data:`MISSING` if it has none; the mode stack: a tuple of modes)."""
    kind, owner, key = _resolve(target)
    if kind == "mode":
        return _mode_stack()
    if kind == "item":
        return owner.get(key, MISSING)
    if isinstance(owner, (type, types.ModuleType)):
        return vars(owner).get(key, MISSING)
    return getattr(owner, key, MISSING)


def _write(target: str, value) -> None:
    kind, owner, key = _resolve(target)
    if kind == "mode":
        value.__enter__()
    elif kind == "item":
        owner[key] = value
    else:
        setattr(owner, key, value)


def _restore(name: str, target: str, original, ours) -> None:
    kind, owner, key = _resolve(target)
    if kind == "mode":
        stack = _mode_stack()
        if not stack or stack[-1] is not ours:
            raise PatchError(f"patch {name!r}: its torch function mode is not the innermost one; exit the modes "
                             "entered after it first")
        ours.__exit__(None, None, None)
        return
    if read(target) is not ours:
        raise PatchError(f"patch {name!r}: {target} was replaced outside the registry while the patch held it; "
                         f"install changes to megatron-core through megatron_vlm/runtime/mcore_patches.py")
    if original is MISSING:
        if kind == "item":
            del owner[key]
        else:
            delattr(owner, key)
    else:
        _write(target, original)


def _install(name: str, params: dict) -> _Record:
    entry = check(name)
    factory = _IMPLEMENTATIONS.get(name)
    if factory is None:
        raise PatchError(f"patch {name!r} has no implementation: its owner {entry.owner} registers it "
                         "(@mcore_patches.implements) when imported")
    wanted = targets(name)
    for other, record in _ACTIVE.items():
        shared = set(wanted) & set(record.targets)
        if shared:
            raise PatchError(f"patch {name!r} would replace {', '.join(sorted(shared))}, which patch {other!r} holds")
    originals = {t: read(t) for t in wanted}
    values = factory(dict(originals), **params)
    if set(values) != set(wanted):
        extra, missing = sorted(set(values) - set(wanted)), sorted(set(wanted) - set(values))
        raise PatchError(f"patch {name!r}'s implementation changes {extra or 'nothing more'} and leaves "
                         f"{missing or 'nothing'} of what its entry declares: the entry and {entry.owner} must agree")
    done = []
    try:
        for t in wanted:
            _write(t, values[t])
            done.append(t)
    except BaseException:
        for t in reversed(done):
            _restore(name, t, originals[t], values[t])
        raise
    record = _Record(wanted, originals, values, dict(params))
    _ACTIVE[name] = record
    return record


def _uninstall(name: str) -> None:
    record = _ACTIVE.pop(name)
    errors = []
    for t in reversed(record.targets):
        try:
            _restore(name, t, record.originals[t], record.values[t])
        except PatchError as e:  # that target is someone else's now: the others still get their originals
            errors.append(str(e))
    if errors:
        raise PatchError("; ".join(errors))


def _active_record(name: str, params: dict):
    """The record of patch ``name``, installed now with ``params`` if it is not active (call under ``_LOCK``); an
    active one must have the same ``params``. Every use checks the installed megatron-core against the entry."""
    check(name)
    record = _ACTIVE.get(name)
    if record is None:
        record = _install(name, params)
    elif record.params != params:
        raise PatchError(f"patch {name!r} is active with {record.params}, not {params}")
    return record


def apply(name: str, **params) -> None:
    """Install patch ``name`` for the rest of the process (idempotent; until :func:`undo`)."""
    with _LOCK:
        _active_record(name, params).lasting = True


@contextlib.contextmanager
def applied(name: str, **params):
    """Patch ``name`` for the time of the ``with`` block (a no-op while it is active already, e.g. for the process);
    ``params`` go to its implementation. Every use checks the installed megatron-core against the entry."""
    with _LOCK:
        record = _active_record(name, params)
        record.holds += 1
    try:
        yield
    finally:
        with _LOCK:
            if _ACTIVE.get(name) is record:
                record.holds -= 1
                if record.holds == 0 and not record.lasting:
                    _uninstall(name)


def undo(name: str) -> None:
    """Remove patch ``name`` now, whoever holds it: every target gets its recorded original back (one that did not
    exist is deleted). A no-op when it is not active."""
    with _LOCK:
        if name in _ACTIVE:
            _uninstall(name)


def active() -> list[str]:
    """The names of the patches installed now, in the order they were applied."""
    return list(_ACTIVE)


def is_active(name: str) -> bool:
    return name in _ACTIVE


def originals(name: str) -> dict:
    """The values an active patch's targets had before it (for tests)."""
    return dict(_ACTIVE[name].originals)


def values(name: str) -> dict:
    """What an active patch installed, by target (the mode of a :data:`MODE_STACK` target)."""
    return dict(_ACTIVE[name].values)


def held() -> dict[str, str]:
    """target -> the active patch holding it."""
    return {t: name for name, record in _ACTIVE.items() for t in record.targets}


# ---- the audit: every change to megatron-core's modules and classes is an active patch -----------------------------
#: torch modules whose attributes patches replace (module level only)
_TORCH_MODULES = ("torch.cuda", "torch._dynamo.eval_frame")


def snapshot() -> dict:
    """Every attribute of every imported ``megatron.core`` module and of the classes it defines (with their
    functions' defaults), of :data:`_TORCH_MODULES`, the ``sys.modules`` entries patches name and the mode stack."""
    out = {}
    for name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType) and (name == "megatron.core" or name.startswith("megatron.core.")):
            _attributes(out, name, module, classes=True)
    for name in _TORCH_MODULES:
        if isinstance(sys.modules.get(name), types.ModuleType):
            _attributes(out, name, sys.modules[name], classes=False)
    for entry in PATCHES:
        for t in entry.replaces:
            if t.startswith("sys.modules:"):
                out[t] = sys.modules.get(t.partition(":")[2], MISSING)
    if "torch" in sys.modules:
        out[MODE_STACK] = _mode_stack()
    return out


def _attributes(out: dict, name: str, module, classes: bool) -> None:
    out[f"{name}:"] = module  # the module was there
    for key, value in list(vars(module).items()):
        out[f"{name}:{key}"] = value
        if classes and isinstance(value, type) and value.__module__ == name:
            for ckey, cvalue in list(vars(value).items()):
                out[f"{name}:{key}.{ckey}"] = cvalue
                fn = cvalue.__func__ if isinstance(cvalue, (staticmethod, classmethod)) else cvalue
                if isinstance(fn, types.FunctionType):
                    out[f"{name}:{key}.{ckey}.__defaults__"] = fn.__defaults__
                    out[f"{name}:{key}.{ckey}.__kwdefaults__"] = fn.__kwdefaults__


def _code_like(key: str, value) -> bool:
    """Code (functions, classes, modules, descriptors), or a public flag (megatron-core's import-time ``HAVE_*`` /
    ``USING_*`` choices; a private one such as ``_CUDA_RNG_STATE_TRACKER_INITIALIZED`` is state it keeps)."""
    if isinstance(value, bool):
        return not key.rpartition(":")[2].rpartition(".")[2].startswith("_")
    return callable(value) or isinstance(value, (staticmethod, classmethod, property, types.ModuleType))


def _same(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


def _container(key: str) -> str:
    where, _, path = key.partition(":")
    return f"{where}:{path.rpartition('.')[0]}" if "." in path else f"{where}:"


def unregistered(before: dict, after: dict | None = None) -> list[str]:
    """The attributes that differ between two :func:`snapshot`\\ s (``after``: now) and that no active patch holds:
    code (functions, classes, modules, descriptors), public flags, defaults, the mode stack and the named
    ``sys.modules`` entries. State megatron-core keeps in its modules (groups, trackers, buffers, private flags) is not
    code and is left out, as are attributes of modules and classes that did not exist before and submodules an
    import added to its package."""
    after = snapshot() if after is None else after
    mine = held()
    out = []
    for key in sorted(before.keys() | after.keys()):
        if covered(key, mine) or key.endswith(":"):
            continue
        a, b = before.get(key, MISSING), after.get(key, MISSING)
        if _same(a, b):
            continue
        plain = key.partition(":")[0] not in ("sys.modules", "torch") and not key.endswith(("__defaults__",
                                                                                             "__kwdefaults__"))
        if plain and not (_code_like(key, a) or _code_like(key, b)):
            continue
        if a is MISSING and _container(key) not in before:
            continue  # a new module or class
        if a is MISSING and isinstance(b, types.ModuleType) and b.__name__ == key.replace(":", "."):
            continue  # a submodule that an import bound on its package
        out.append(key)
    return [k for k in out if not (k.endswith(_DEFAULTS) and k.rpartition(".")[0] in out)]  # a function's own


_DEFAULTS = (".__defaults__", ".__kwdefaults__")


def covered(key: str, targets) -> bool:
    """Whether a :func:`snapshot` key is one of ``targets`` or the defaults of a function that one replaces."""
    return key in targets or (key.endswith(_DEFAULTS) and key.rpartition(".")[0] in targets)
