"""DeepSpeed's ZeRO memory estimators with dsrun's own numbers.

The functions keep DeepSpeed's names, arguments and return values
(``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_*`` and
``deepspeed.runtime.zero.stage3.estimate_zero3_*``), but what they estimate
is what a dsrun rank holds, from the formulas the engine's memory lines
use (:mod:`.memory`), in mixed precision (2-byte parameters and gradients,
K = 12: fp32 master, momentum and variance - dsrun's ``fp16``; its
``bf16`` keeps fp32 parameters, like fp32 training, 4 + 4 + 8 bytes).
DeepSpeed's own figures differ (its stage 2 also counts fp32 gradients);
the model state is what they count, activations and buffers are not.

Per device (GPU), N ranks in all, Ψ parameters, L the largest layer's:

* stage 2, no offload: ``2Ψ + (2 + 12)Ψ/N``; offload_optimizer: ``2Ψ +
  2Ψ/N`` (parameters and this rank's gradient bucket share);
* stage 3, no offload: ``(2 + 2 + 12)Ψ/N + 2L`` (the gathered layer);
  offload_optimizer: ``(2 + 2)Ψ/N + 2L``; with offload_param as well,
  ``2Ψ/N + 2L`` (gradients on the device, shards in host memory).

Per node (CPU), ``ranks_per_node`` of them, times
``additional_buffer_factor`` as in DeepSpeed: an offloaded optimizer keeps
the fp32 master, its gradient accumulator and two moments (16Ψ/N per
rank); offloaded parameter shards add 2Ψ/N; without ``zero.Init`` every
rank first builds the whole model in fp32 on the host (4Ψ each); without
offload the host holds what loading the model takes (4Ψ per rank, or 4L
under ``zero.Init``).
"""

from __future__ import annotations

from typing import Any

import torch

from dsrun.runtime.zero.memory import zero_model_state_bytes

__all__ = [
    "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live", "model_to_params",
]

GiB = 2**30
HALF, MASTER_STATE, HOST_STATE = 2, 12, 16  # bytes per parameter (module docstring)


def model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, counting shared ones once; the largest module's own)."""
    total = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False))
                   for m in model.modules()), default=0)
    return total, largest


def _check(total_params: float, ranks_per_node: int, num_nodes: int) -> int:
    if total_params < 0 or ranks_per_node < 1 or num_nodes < 1:
        raise ValueError(f"need total_params >= 0 and at least one rank and node, got "
                         f"{total_params}, {ranks_per_node} per node, {num_nodes} nodes")
    return ranks_per_node * num_nodes


def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5
                                          ) -> tuple[int, int]:
    """(host bytes per node, device bytes per rank) at ZeRO stage 2."""
    ranks = _check(total_params, num_gpus_per_node, num_nodes)
    share = total_params / ranks
    # the engine's formula; offloaded optimizer state is not on the device
    device = zero_model_state_bytes(total_params, ranks, 2, param_bytes=HALF, grad_bytes=HALF,
                                    optimizer_bytes=0 if cpu_offload else MASTER_STATE)
    if cpu_offload:
        host = HOST_STATE * share * num_gpus_per_node
    else:
        host = 4 * total_params * num_gpus_per_node
    return int(host * additional_buffer_factor), int(device)


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int,
                                          num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          cpu_offload_params: bool = True,
                                          zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5
                                          ) -> tuple[int, int, int]:
    """(host bytes per node, device bytes per rank, the gathered largest
    layer's bytes) at ZeRO stage 3."""
    ranks = _check(total_params, num_gpus_per_node, num_nodes)
    share = total_params / ranks
    layer = HALF * largest_layer_params
    # the engine's formula plus the gathered layer; what is offloaded is not
    # on the device (gradients always are)
    device = layer + zero_model_state_bytes(
        total_params, ranks, 3, param_bytes=0 if cpu_offload and cpu_offload_params else HALF,
        grad_bytes=HALF, optimizer_bytes=0 if cpu_offload else MASTER_STATE)
    if cpu_offload and cpu_offload_params:
        host = (HOST_STATE + HALF) * share * num_gpus_per_node
    elif cpu_offload:
        host = HOST_STATE * share * num_gpus_per_node
    else:
        host = 4 * largest_layer_params * num_gpus_per_node if zero_init else 0
    if not zero_init:
        host = max(host, 4 * total_params * num_gpus_per_node)
    return int(host * additional_buffer_factor), int(device), int(layer)


def _header(total_params: int, ranks_per_node: int, num_nodes: int, extra: str = "") -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if ranks_per_node > 1 else "GPU"
    print("Estimated memory needed for params, optim states and gradients (dsrun, fp16 "
          f"model states) for a:\nHW: Setup with {num_nodes} {nodes}, {ranks_per_node} "
          f"{gpus} per node.\nSW: Model with {int(total_params / 1e6)}M total params{extra}.")
    print("  per CPU  |  per GPU |   Options")


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int,
                                                   num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5
                                                   ) -> None:
    """Print the stage-2 table for ``total_params`` parameters."""
    _header(total_params, num_gpus_per_node, num_nodes)
    for offload in (True, False):
        host, device = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor)
        print(f" {host / GiB:7.2f}GB | {device / GiB:6.2f}GB | "
              f"offload_optimizer={'cpu ' if offload else 'none'}")


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module,
                                                   num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5
                                                   ) -> None:
    """Print the stage-2 table for ``model``'s parameters."""
    estimate_zero2_model_states_mem_needs_all_cold(model_to_params(model)[0], num_gpus_per_node,
                                                   num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5
                                                   ) -> None:
    """Print the stage-3 table for a model of that size."""
    _header(total_params, num_gpus_per_node, num_nodes,
            f", {int(largest_layer_params / 1e6)}M largest layer params")
    options: list[Any] = [(True, True), (True, False), (False, False)]
    for offload, offload_params in options:
        for zero_init in (True, False):
            host, device, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes, offload,
                offload_params, zero_init, additional_buffer_factor)
            print(f" {host / GiB:7.2f}GB | {device / GiB:6.2f}GB | "
                  f"offload_param={'cpu ' if offload_params else 'none'}, "
                  f"offload_optimizer={'cpu ' if offload else 'none'}, "
                  f"zero_init={int(zero_init)}")


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module,
                                                   num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5
                                                   ) -> None:
    """Print the stage-3 table for ``model``'s parameters."""
    total, largest = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)
