"""torchtitan's trainer (`torchtitan.train`) on CPU, for tests: torchrun runs this file with torchtitan's arguments.

Why a shim: torchtitan 0.3 assumes an accelerator. On a CPU-only torch `torchtitan.tools.utils` takes "cuda" as the
device (`_get_available_device_type() or "cuda"`) and `Trainer.__init__` dies at `device_module.set_device`
(AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'); with "cpu", its memory monitor calls
`get_device_name`, `memory_stats` and more, which `torch.cpu` lacks. So before torchtitan is imported, the device
type is "cpu" and its module answers those calls as a device with no memory statistics; everything else is
torchtitan's, on gloo (its backend for "cpu"). Pass --training.disable_cuda_graphs.

triton: `torchtitan.trainer` imports, through its MoE token dispatcher, the Triton kernels of MinimalAsyncEP (expert
parallelism over CUDA symmetric memory), and triton is not among its declared dependencies (a 286 MB wheel). The
dense debug model never calls them, so that one module is replaced by one whose kernels refuse to run, by name: a
call would fail loudly, never compute anything. triton itself is not faked (torch asks whether triton is importable
to choose its compiler backends).

`LOADER_TITAN_KILL=STEP:RANK` SIGKILLs that rank after it trained step STEP, before the step's checkpoint would be
saved, once per run directory (a marker in --dump_folder).
"""

import os
import signal
import sys
import types
from pathlib import Path

import torch
import torch._utils

CPU = types.SimpleNamespace(
    set_device=lambda device: None,
    current_device=lambda: 0,
    device_count=lambda: 1,
    synchronize=lambda *a: None,
    get_device_name=lambda device=None: "cpu",
    empty_cache=lambda: None,
    reset_peak_memory_stats=lambda *a: None,
    memory_stats=lambda *a: {},
    get_device_properties=lambda device=None: types.SimpleNamespace(name="cpu", total_memory=1 << 34),
)


KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _no_kernel(name: str):
    """The stand-in for one of MinimalAsyncEP's Triton kernels (module `__getattr__`, PEP 562)."""
    if name.startswith("__"):  # what importlib and inspect ask a module: not a kernel
        raise AttributeError(name)

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{KERNELS}.{name}: a Triton kernel of MinimalAsyncEP, not on CPU (tests/titan_job.py)")

    return refuse


def without_triton_kernels() -> None:
    kernels = types.ModuleType(KERNELS)
    kernels.__getattr__ = _no_kernel
    sys.modules[KERNELS] = kernels


def llama3_debugmodel_loader_cpu():
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    from examples.torchtitan_loader import llama3_debugmodel_loader

    config = llama3_debugmodel_loader()
    for _, _, parent, field in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, field, ScaledDotProductAttention.Config())
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"
    config.model_spec.parallelize_fn = summing(config.model_spec.parallelize_fn)
    return config


def summing(parallelize):
    from torch.distributed.fsdp import FSDPModule

    def parallelize_summing(model, **options):
        model = parallelize(model, **options)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize_summing


def kill_after(step: int, rank: int, marker: Path) -> None:
    from torchtitan.trainer import Trainer

    train_step = Trainer.train_step

    def striking(self, data_iterator):
        train_step(self, data_iterator)
        if self.step == step and torch.distributed.get_rank() == rank and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer.train_step = striking


def main() -> None:
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type="cpu": CPU
    without_triton_kernels()
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.train import main as train

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None

    if "LOADER_TITAN_KILL" in os.environ:
        step, rank = map(int, os.environ["LOADER_TITAN_KILL"].split(":"))
        dump = Path(sys.argv[sys.argv.index("--dump_folder") + 1])
        kill_after(step, rank, dump / f"killed-at-{step}")
    train()


if __name__ == "__main__":
    main()
