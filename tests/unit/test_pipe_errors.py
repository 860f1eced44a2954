"""The pipeline's errors are also DeepSpeed 0.19.8's built-in classes for
the same misuse (pure parts: topology, partitioning, payloads), so a
DeepSpeed script's ``except RuntimeError`` (etc.) still catches them."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.pipe import errors
from dsrun.runtime.pipe.p2p import flatten_payload
from dsrun.runtime.pipe.partition import layer_weights, partition_layers
from dsrun.runtime.pipe.topology import PipeDataParallelTopology, ProcessTopology, topology_for


@pytest.mark.parametrize("cls, builtin", [
    (errors.PipeRuntimeError, RuntimeError),
    (errors.PipeConfigRuntimeError, RuntimeError),
    (errors.PipeAssertionError, AssertionError),
    (errors.PipeNotImplementedError, NotImplementedError),
    (errors.PipeTypeError, TypeError),
])
def test_each_class_is_dsruns_and_deepspeeds(cls: type, builtin: type) -> None:
    with pytest.raises(builtin, match="^the message$") as info:
        raise cls("the message")
    assert isinstance(info.value, DsrunError)
    if cls is not errors.PipeRuntimeError:  # the rest are about how the pipeline is set up
        assert isinstance(info.value, DsrunConfigError)


CASES: list[tuple[type, str, Callable[[], Any]]] = [
    # DeepSpeed: RuntimeError('must provide num_stages or topology')
    (RuntimeError, "needs num_stages= \\(or topology=\\)", lambda: topology_for(4)),
    # DeepSpeed: RuntimeError('num_stages (3) must divide distributed world size (4)')
    (RuntimeError, "num_stages=3 does not divide the world size 4",
     lambda: topology_for(4, num_stages=3)),
    # DeepSpeed's grid: assert self._is_grid_valid(), "Invalid Grid"
    (AssertionError, "does not match the world size 4",
     lambda: topology_for(4, topology=PipeDataParallelTopology(3, 1))),
    # DeepSpeed: assert key in self.mapping
    (AssertionError, "outside the topology",
     lambda: ProcessTopology(["pipe", "data"], [2, 2]).get_rank(pipe=2, data=0)),
    # DeepSpeed: NotImplementedError(f'Partitioning method {method} not implemented.')
    (NotImplementedError, "'profile' \\(timing each layer\\) is not implemented",
     lambda: layer_weights("profile", ["A"], [1])),
    (NotImplementedError, "unknown partition_method='fastest'",
     lambda: partition_layers("fastest", 1, ["A"], [1])),
    # DeepSpeed's _find_layer_type: RuntimeError(f"Partitioning '{layername}' found no ...")
    (RuntimeError, "no layer class name matches 'conv'",
     lambda: partition_layers("type:conv", 1, ["Linear"], [1])),
    # DeepSpeed: NotImplementedError('Could not send output of type ...')
    (NotImplementedError, "the output of stage 0 is a dict",
     lambda: flatten_payload({"h": torch.zeros(1)}, "the output of stage 0")),
    # DeepSpeed asserts each input of a micro-batch is a tensor
    (AssertionError, "inputs is a tuple of \\(Tensor, int\\)",
     lambda: flatten_payload((torch.zeros(1), 3), "inputs", errors.PipeAssertionError)),
]


@pytest.mark.parametrize("builtin, message, call", CASES)
def test_misuse_raises_deepspeeds_class(builtin: type, message: str,
                                        call: Callable[[], Any]) -> None:
    with pytest.raises(builtin, match=message) as info:
        call()
    assert isinstance(info.value, DsrunError)
