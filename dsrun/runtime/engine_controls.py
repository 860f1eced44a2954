"""What a running engine's owner may change or ask it to do: DeepSpeed's
``set_train_batch_size`` / ``set_train_micro_batch_size``
(:mod:`dsrun.runtime.batch_size`), ``compile`` (:mod:`dsrun.runtime.compile`),
``enable_backward_allreduce`` with ``allreduce_gradients()``,
``deepspeed_io`` (a data loader over a dataset),
``load_module_state_dict``, ``save_16bit_model``, ``scale(loss)`` for a script's own
``loss.backward()`` (:mod:`dsrun.runtime.direct_backward`), the accumulation round
(``is_gradient_accumulation_boundary``,
``set_gradient_accumulation_boundary``, DeepSpeed's ``inside_no_sync_ctxt``)
and ``train()``/``eval()``, as a mixin of
:class:`~dsrun.runtime.engine.DsrunEngine`.

``enable_backward_allreduce`` (default True): at ZeRO stage 0, False makes
``backward()`` leave each rank's local gradients (the gradient-sync hooks
stay disarmed) until the script calls ``allreduce_gradients()``, which
averages them with the same buckets and arithmetic the hooks use, so the
result is bitwise what ``backward()`` would have left. ZeRO stages 1-3
reduce inside their optimizer (during backward or at the step), so there
False is refused by name; so are DeepSpeed attributes dsrun cannot honour
(``gradient_average = False``): setting them must not be a silent no-op.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.batch_size import resize_batch
from dsrun.runtime.compile import compile_module
from dsrun.runtime.constants import (  # DeepSpeed's names, also importable from here
    MEMORY_OPT_ALLREDUCE_SIZE,
    ROUTE_EVAL,
    ROUTE_PREDICT,
    ROUTE_TRAIN,
)
from dsrun.runtime.dataloader import build_dataloader, engine_step_clock

__all__ = ["EngineControls", "MEMORY_OPT_ALLREDUCE_SIZE", "ROUTE_EVAL", "ROUTE_PREDICT",
           "ROUTE_TRAIN"]


class EngineControls:
    """Mixed into the engine: reads and sets its ``_compiled``, ``config``,
    gradient-sync switch and counters."""

    module: Any
    config: Any
    zero_stage: int
    is_pipe_parallel: bool
    dp_world_size: int
    device: torch.device
    _compiled: Any
    _step_profiler: Any
    _grad_sync: Any
    _backward_allreduce: bool
    mpu: Any
    micro_steps: int
    _round_origin: int
    _boundary_override: Optional[bool]
    _backwards_since_boundary: int
    _direct_backward: Any
    _partition_only: bool
    _inside_no_sync: bool
    warn_unscaled_loss: bool
    optimizer: Any
    precision: Any
    _grad_norm: Any
    _step_applied: bool
    publish_step_state: Callable[..., None]
    _log_overflow: Callable[[float], None]

    # ------------------------------------------------- gradient reduction

    @property
    def enable_backward_allreduce(self) -> bool:
        """Whether ``backward()`` averages gradients over the data-parallel
        group (module docstring). False on a pipeline engine, as in
        DeepSpeed: its schedule reduces them."""
        return self._backward_allreduce and not self.is_pipe_parallel

    @enable_backward_allreduce.setter
    def enable_backward_allreduce(self, value: bool) -> None:
        value = bool(value)
        if self.is_pipe_parallel:
            if value:
                raise DsrunError("engine.enable_backward_allreduce = True on a pipeline engine: "
                                 "its schedule reduces gradients once per batch; leave it False")
            return
        if not value and self.zero_stage > 0:
            raise DsrunError(
                f"engine.enable_backward_allreduce = False is not implemented at ZeRO stage "
                f"{self.zero_stage}: dsrun's ZeRO optimizer reduces gradients itself (during "
                "backward or at the step). Use ZeRO stage 0 to reduce them yourself with "
                "engine.allreduce_gradients(), or engine.no_sync() to skip reductions while "
                "accumulating")
        self._backward_allreduce = value

    @property
    def gradient_average(self) -> bool:
        """Gradients are averaged (not summed) over the data-parallel group:
        always in dsrun (DeepSpeed's ``gradient_allreduce_op`` ``"mean"``)."""
        return True

    @gradient_average.setter
    def gradient_average(self, value: bool) -> None:
        if not value:
            raise DsrunError("engine.gradient_average = False (summing gradients over ranks "
                             "instead of averaging) is not implemented in dsrun; scale the "
                             "loss by the data-parallel size instead")

    def allreduce_gradients(self, bucket_size: int = MEMORY_OPT_ALLREDUCE_SIZE) -> None:
        """Average the gradients the parameters hold over the data-parallel
        group now (DeepSpeed's; ``bucket_size`` is not used: the engine's
        buckets are). At ZeRO stage 0 and an accumulation boundary only, as
        DeepSpeed; a parameter without a gradient contributes zeros. ZeRO
        stages reduce inside their optimizer: nothing to do there."""
        if self.zero_stage > 0 or self._grad_sync is None or \
                not self.is_gradient_accumulation_boundary():
            return
        with self.monitor.comm_wait("reduce"):
            self._grad_sync.all_reduce_accumulated()

    # ---------------------------------------------------- data and weights

    def deepspeed_io(self, dataset: Any, batch_size: Optional[int] = None,
                     route: str = ROUTE_TRAIN, pin_memory: bool = True,
                     data_sampler: Any = None,
                     collate_fn: Optional[Callable[[list[Any]], Any]] = None,
                     num_local_io_workers: Optional[int] = None) -> Any:
        """A data loader over ``dataset`` for this data-parallel rank, as
        DeepSpeed's: ``route="train"`` (default) gives the loader
        ``initialize(training_data=)`` gives (this rank's shard, shuffled,
        the micro-batch size); ``"eval"``/``"predict"`` this rank's shard in
        order; a ``data_sampler`` is used as given. The config's
        ``dataloader_drop_last`` applies; without ``collate_fn``, the one
        given to ``initialize()``. Every loader has DeepSpeed's
        ``data_sampler`` attribute. ``save_checkpoint`` warns of a
        ``"train"`` loader of a Dataset (no sampler, no workers) that the
        engine trained from (a step between two of its batches) and that is
        not ``engine.training_dataloader``: its position is not saved. An
        evaluation loader built with the default route is not warned of;
        a ``"train"`` loader with a ``data_sampler`` or workers (a torch
        DataLoader, whose position dsrun never saves) is named once, as
        one that may be trained from."""
        if not (self.is_map_style_dataset(dataset) or self.is_iterable_style_dataset(dataset)):
            raise ValueError("Training data must be a torch Dataset")
        size = self.config.train_micro_batch_size_per_gpu if batch_size is None else batch_size
        replicas, rank = self.dp_world_size, self._dp_rank()
        pin = pin_memory and self.device.type == "cuda"
        if collate_fn is None:  # DeepSpeed's fallback: initialize()'s collate_fn
            collate_fn = self.__dict__.get("collate_fn")
        if data_sampler is None and route == ROUTE_TRAIN and num_local_io_workers is None:
            return self._train_loader(build_dataloader(
                dataset, micro_batch_size=size, num_replicas=replicas, rank=rank,
                collate_fn=collate_fn, drop_last=self.config.dataloader_drop_last,
                device=self.device, tput_timer=self.tput_timer,
                step_clock=engine_step_clock(self)))
        if data_sampler is None:
            data_sampler = torch.utils.data.DistributedSampler(
                dataset, num_replicas=replicas, rank=rank, shuffle=route == ROUTE_TRAIN)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=size, sampler=data_sampler, collate_fn=collate_fn,
            drop_last=self.config.dataloader_drop_last, pin_memory=pin,
            num_workers=num_local_io_workers or 0)
        loader.data_sampler = data_sampler  # DeepSpeed's name (loader.data_sampler.set_epoch)
        # a torch DataLoader cannot tell whether the engine trained from it:
        # a save names it with a softer warning (see unsaved_loaders)
        return self._train_loader(loader) if route == ROUTE_TRAIN else loader

    def _train_loader(self, loader: Any) -> Any:
        """Remember a training loader: ``save_checkpoint`` warns when it is
        not ``engine.training_dataloader`` (the only one whose position is saved)."""
        self.__dict__.setdefault("_train_io_loaders", weakref.WeakSet()).add(loader)
        return loader

    def _dp_rank(self) -> int:
        if self.mpu is not None:
            return int(self.mpu.get_data_parallel_rank())
        return torch.distributed.get_rank(self.data_parallel_group)

    def module_state_dict(self, destination: Any = None, prefix: str = "",
                          keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The module's ``state_dict()`` (DeepSpeed's name), without frozen
        parameters when asked (at ZeRO stage 3 the parameters hold only
        this rank's: gather with ``GatheredParameters`` or use ``save_16bit_model``)."""
        state = self.module.state_dict(destination=destination, prefix=prefix,
                                       keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(self, checkpoint: dict[str, Any], strict: bool = True,
                               custom_load_fn: Any = None, fetch_z3_params: bool = False,
                               z3_params_to_fetch: Any = None,
                               allowed_missing_keys: Any = None) -> None:
        """Load ``checkpoint["module"]`` into the module (DeepSpeed's;
        ``custom_load_fn(src=, dst=)`` instead when given); every rank loads
        the same dict. The fp32 masters (fp16, ZeRO stages) take the loaded
        values, so the next step trains from them; at ZeRO stage 3 the
        parameters are gathered around the load (``fetch_z3_params`` is
        implied) and re-partitioned from rank 0's values."""
        state = checkpoint["module"]
        with self._gathered_for_load():
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
            else:
                result = self.module.load_state_dict(
                    state, strict=strict and allowed_missing_keys is None)
                if strict and allowed_missing_keys is not None:
                    missing = set(result.missing_keys) - set(allowed_missing_keys)
                    if missing or result.unexpected_keys:
                        raise RuntimeError(
                            f"load_module_state_dict: missing keys {sorted(missing)}, "
                            f"unexpected keys {sorted(result.unexpected_keys)}")
        if self.zero_stage != 3:
            from dsrun.utils.tensor_fragment import safe_set_full_fp32_param

            with torch.no_grad():
                for param in self.module.parameters():
                    safe_set_full_fp32_param(param, param.detach().float().clone())

    def _gathered_for_load(self) -> Any:
        """Stage 3: every parameter gathered, rank 0's values published on
        exit (shards and masters refreshed); other stages: nothing."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        from dsrun.runtime.zero.init import GatheredParameters

        return GatheredParameters(list(self.module.parameters()), modifier_rank=0)

    # ------------------------------------------------- compile and batch size

    def _forward_module(self) -> Any:
        """The compiled module after engine.compile(), except on the flops
        profiler's step (its counts need every operator dispatched)."""
        if self._compiled is None or (self._step_profiler is not None
                                      and self._step_profiler.active()):
            return self.module
        return self._compiled

    def compile(self, backend: Any = None,  # type: ignore[override]
                compile_kwargs: Optional[dict[str, Any]] = None, schedule: Any = None) -> None:
        """DeepSpeed's: ``torch.compile`` the module for the engine's forward
        (:mod:`dsrun.runtime.compile`; stages 0-2)."""
        compiled = compile_module(self, backend, compile_kwargs, schedule)
        if compiled is not None:
            # not a submodule of the engine: its state dict and parameters
            # stay those of engine.module alone
            self.__dict__["_compiled"] = compiled

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    def _step_from_optimizer(self) -> None:
        """``optimizer.step()`` on the ZeRO optimizer ``initialize()``
        returned (Lightning Fabric calls it instead of ``engine.step()``): the
        step ``engine.step()`` takes - fp16 unscale and overflow skip,
        clipping - as DeepSpeed's ZeRO optimizers take it in their own
        ``step()``, without moving the engine's counters or LR schedule."""
        from dsrun.runtime.checkpoint import engine_io
        from dsrun.runtime.zero.stepping import zero_step

        engine_io.before_step(self)  # an async save may still be copying the state
        scale_before = self.precision.loss_scale
        result = zero_step(self.optimizer, self.precision, self.config.gradient_clipping)
        self._grad_norm = result.grad_norm
        self._step_applied = result.applied
        self.publish_step_state(result.overflow)
        if result.overflow:  # said as engine.step() says it (its counters stay, as DeepSpeed's)
            self._log_overflow(scale_before)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's: ``loss`` times the fp16 loss scale (unchanged without
        one), for a script's own ``engine.scale(loss).backward()``."""
        if self._partition_only or self.optimizer is None:
            raise DsrunError("engine.scale(loss) needs an optimizer: the engine was built "
                             "without one")
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            raise DsrunError("engine.scale(loss): loss must be a scalar tensor that requires "
                             "grad; for another tensor call tensor.backward(gradient)")
        scaled = self.precision.scale_loss(loss)
        self._direct_backward.scaled(scaled)  # a backward of this tensor is scaled
        return scaled

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The weights in 16-bit as one torch.save file (rank 0 writes it)."""
        from dsrun.runtime.checkpoint.model16 import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's deprecated name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[dict[str, torch.Tensor]]:
        """Stage 3: the full 16-bit state dict on rank 0, None elsewhere
        (DeepSpeed's, used by Hugging Face); every rank must call it."""
        from dsrun.runtime.checkpoint.model16 import zero3_consolidated_16bit_state_dict

        return zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch, as more or fewer micro-batches
        per step (the micro-batch size is kept); between steps only."""
        resize_batch(self, train=train_batch_size)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch size, the accumulation steps kept."""
        resize_batch(self, micro=micro_batch_size)

    def train(self, mode: bool = True) -> Any:
        """torch's (``eval()`` calls it too); as DeepSpeed's, it also sets
        ``warn_unscaled_loss`` back to True."""
        self.warn_unscaled_loss = True
        return super().train(mode)  # type: ignore[misc]  # torch.nn.Module's, next in the MRO

    # ------------------------------------------------ accumulation rounds

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without all-reducing them."""
        if self.zero_stage > 0 and self.optimizer.backward_hook_installed:
            why = "stage 1 without gradient accumulation" if self.zero_stage == 1 else \
                f"stage {self.zero_stage}"
            raise DsrunError(f"engine.no_sync() is not possible at ZeRO stage "
                             f"{self.zero_stage} here: gradients are reduced during every "
                             f"backward ({why}), as in DeepSpeed; use "
                             "gradient_accumulation_steps > 1 with stage 1, or stage 0, and "
                             "call engine.step() outside the no_sync() block (a Hugging Face "
                             "Trainer of transformers < 4.47 calls it inside: upgrade it)")
        previous, self._inside_no_sync = self._inside_no_sync, True
        try:
            yield
        finally:
            self._inside_no_sync = previous

    @property
    def inside_no_sync_ctxt(self) -> bool:
        """DeepSpeed's attribute: True inside ``engine.no_sync()``."""
        return self._inside_no_sync

    @inside_no_sync_ctxt.setter
    def inside_no_sync_ctxt(self, value: bool) -> None:
        raise DsrunError(f"engine.inside_no_sync_ctxt = {value!r}: dsrun sets it only "
                         "through engine.no_sync(), which checks that this ZeRO stage can "
                         "skip the gradient reduction; use `with engine.no_sync():`")

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return self.micro_in_round() + 1 == self.config.gradient_accumulation_steps

    def micro_in_round(self) -> int:
        """Micro-steps taken in the current accumulation round (0 at a boundary).

        Rounds are counted from the last change of their length - a new batch
        size, or a checkpoint loaded into this engine - not from micro-step 0,
        so a resize or a resume with other accumulation steps starts a full
        round. Where the script sets the boundaries
        (``set_gradient_accumulation_boundary``, Accelerate's way, calling
        ``step()`` only at a boundary), the backwards since the last
        boundary step."""
        if self._boundary_override is not None:
            return self._backwards_since_boundary
        return (self.micro_steps - self._round_origin) % self.config.gradient_accumulation_steps

    def start_accumulation_round(self) -> None:
        """The next micro-step is the first of an accumulation round."""
        self._round_origin = self.micro_steps
        self._backwards_since_boundary = 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Whether the following micro-steps end an accumulation round, until
        set again (DeepSpeed's API and semantics: the value stays; it
        replaces the count of gradient_accumulation_steps)."""
        self._boundary_override = bool(is_boundary)
