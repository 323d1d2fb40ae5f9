"""What the tool scripts that compare against PyTorch + Accelerate FSDP on CPU processes share.

Accelerate turns an `fsdp_plugin` into FSDP only on accelerators: with `cpu=True` it runs DDP
(MULTI_CPU, every rank a full replica, `save_state` writing model.safetensors). Its FSDP code
paths run on CPU as they are, so this switches its state to FSDP.
"""
import torch


def accelerator_with_fsdp(plugin):
    """An `Accelerator` on CPU processes that prepares models with FSDP and saves as FSDP."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    acc.state.device = torch.device("cpu")  # not cpu:0, which FSDP's device check refuses
    return acc
