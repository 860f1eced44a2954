"""How :class:`~dsrun.runtime.engine.DsrunEngine` is built from the
client's model, optimizer and scheduler and the config, as a mixin: the
stage-0 gradient all-reduce (:class:`~dsrun.runtime.grad_sync.GradSync`),
the optimizer (the client's object or callable, else the config's; empty
param groups dropped, frozen parameters tracked, at stage 0 parameters
added later with ``add_param_group`` too: :mod:`added_params`), the ZeRO
optimizer that wraps it at stages 1-3 (ZeRO++ refused, ``offload_*``
notes), and the
LR scheduler (the client's, or a callable given the torch optimizer that
steps, else the config's). Also the checks :func:`dsrun.initialize` runs
before building (:func:`check_zero_stage`, :func:`check_prepartitioned`,
:func:`check_expert_params`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from dsrun.errors import DsrunConfigError
from dsrun.moe.utils import is_moe_param
from dsrun.runtime.added_params import AddedParams
from dsrun.runtime.config import DsrunConfig
from dsrun.runtime.grad_sync import DEFAULT_BUCKET_BYTES, GradSync
from dsrun.runtime.lr_schedules import (
    build_scheduler,
    needs_lr_kwargs,
    needs_metric,
    takes_an_argument,
)
from dsrun.runtime.norms import model_parallel_of
from dsrun.runtime.optimizers import build_optimizer
from dsrun.runtime.precision import FullPrecision, torch_dtype
from dsrun.runtime.sparse_grads import refuse_at_zero, refuse_in_16_bits, sparse_grad_params
from dsrun.runtime.zero.groups import TAKEN_OVER, check_tested_optimizer
from dsrun.runtime.zero.stepping import DEEPSPEED_DEFAULT_BUCKET, offload_notes, wrap_optimizer

log = logging.getLogger("dsrun.runtime.engine")

IMPLEMENTED_STAGES = (0, 1, 2, 3)


def check_zero_stage(config: DsrunConfig) -> None:
    stage = config.zero_optimization.stage
    if stage not in IMPLEMENTED_STAGES:
        raise DsrunConfigError(
            f"ZeRO stage {stage} is not implemented yet (zero_optimization.stage in "
            f"{config.source}); dsrun implements stages "
            f"{', '.join(map(str, IMPLEMENTED_STAGES))}")


def bucket_elements(config: DsrunConfig) -> Optional[int]:
    """The all-reduce bucket size in elements the config asks for, or None for
    the default. DeepSpeed's 5e8-element reduce_bucket_size default (sized for
    ZeRO-2) would make one bucket and no overlap, so it counts as unset."""
    if config.dsrun.allreduce_bucket_size is not None:
        return config.dsrun.allreduce_bucket_size
    size = config.zero_optimization.reduce_bucket_size
    return None if size == DEEPSPEED_DEFAULT_BUCKET else size


def _check_droppable(optimizer: Optimizer, client: Any, scheduler: Any) -> None:
    """Empty param groups are dropped (as DeepSpeed does); a client LR
    scheduler already built over the client's optimizer counts its groups
    (torch's LambdaLR would fail at its first step), so refuse that at once."""
    empty = [i for i, g in enumerate(optimizer.param_groups) if not len(g["params"])]
    if empty and optimizer is client and hasattr(scheduler, "step") \
            and getattr(scheduler, "optimizer", None) is client:
        raise DsrunConfigError(
            f"param group(s) {', '.join(map(str, empty))} of the optimizer passed to "
            "initialize() have no parameters: dsrun drops empty param groups (as DeepSpeed "
            "does), which breaks the lr_scheduler built over that optimizer; remove the empty "
            "groups before building the scheduler, or pass lr_scheduler as a callable that "
            "takes the optimizer")


def check_optimizer_params(optimizer: Optimizer, module: torch.nn.Module,
                           precision: FullPrecision, stage: int) -> None:
    """Every tensor of the optimizer's param groups is one of ``module``'s
    (or its fp32 master), in one place only (stages 0-2; stage 3 checks its
    own groups, in the same words). A parameter listed twice was stepped
    twice per step at stage 0 (DeepSpeed refuses it at every stage); tensors
    of another copy of the model were stepped while the module's gradients
    were never applied - a flat loss with no message."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names[id(param)] = names[id(precision.optimizer_tensor(param))] = name
    shapes = {tuple(p.shape): n for n, p in reversed(list(module.named_parameters()))}
    seen: set[int] = set()
    foreign: list[tuple[str, str]] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            where = f"param group {g}, parameter {i} (shape {tuple(p.shape)})"
            if id(p) in seen:
                raise DsrunConfigError(f"{where} appears in more than one place"
                                       + (f" (the module's {names[id(p)]!r})"
                                          if id(p) in names else ""))
            seen.add(id(p))
            if id(p) not in names:
                twin = shapes.get(tuple(p.shape))  # a copy's tensor: its original's name
                foreign.append((where, f" ({twin!r} has that shape: a copy of it?)"
                                if twin else ""))
    own = len(seen) - len(foreign)
    if foreign and stage == 0 and own:
        # Module parameters plus extra tensors (a learnable loss temperature):
        # DeepSpeed's stage 0 steps them too, with each rank's own gradient.
        log.warning("%d tensor(s) in the optimizer's param groups are not parameters of the "
                    "module, e.g. %s: they are stepped with each rank's own gradient, not "
                    "averaged across ranks (as in DeepSpeed); make them module parameters "
                    "to keep the replicas equal", len(foreign), foreign[0][0])
    elif foreign:
        raise DsrunConfigError(
            f"{len(foreign)} tensor(s) in the optimizer's param groups are not parameters of "
            f"the module passed to initialize(), e.g. {foreign[0][0]} is not a parameter of "
            f"the module{foreign[0][1]}: "
            + (f"ZeRO stage {stage} steps the module's parameters only (make extra tensors "
               "parameters of the module)" if own else
               f"ZeRO stage {stage} steps the module's parameters, so these would be stepped "
               "and the module never; build model_parameters (or the optimizer) from the "
               "model given to initialize(), not from a copy of it"))


def check_prepartitioned(module: torch.nn.Module, config: DsrunConfig) -> None:
    """A model built under ``dsrun.zero.Init`` must already have the dtype
    training uses: its released parameters cannot be cast afterwards."""
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_shape")]
    if not partitioned:
        return
    if config.zero_optimization.stage != 3:
        raise DsrunConfigError(
            f"the model was built under dsrun.zero.Init (partitioned parameters) but "
            f"{config.source} sets ZeRO stage {config.zero_optimization.stage}: use stage 3")
    if config.fp16.enabled and any(p.dtype != torch.float16 for p in partitioned):
        raise DsrunConfigError("fp16 is enabled but the model was built under dsrun.zero.Init "
                               "in another dtype: build it under "
                               "dsrun.zero.Init(dtype=torch.float16)")


def check_expert_params(module: torch.nn.Module) -> None:
    """Refuse a model with DeepSpeed expert parameters (``allreduce = False``,
    DeepSpeed's ``is_moe_param``; its ``MoE`` layers and Megatron's experts
    tag them so, with ``group_name``): DeepSpeed reduces their gradients
    over their expert data-parallel group, and dsrun, which has no expert
    parallelism, would average them over every data-parallel rank like a
    dense parameter's. DeepSpeed 0.19.8 refuses such a model too when its
    expert groups are not set up; it checks every parameter, frozen or not."""
    tagged = [(name, p) for name, p in module.named_parameters() if is_moe_param(p)]
    if not tagged:
        return
    shown = ", ".join(f"{name!r} (expert group {getattr(p, 'group_name', None)!r})"
                      for name, p in tagged[:4])
    more = f" and {len(tagged) - 4} more" if len(tagged) > 4 else ""
    raise DsrunConfigError(
        f"{len(tagged)} parameter(s) of the model passed to initialize() are DeepSpeed expert "
        f"parameters (allreduce=False): {shown}{more}. Expert parallelism (DeepSpeed's MoE "
        "layers, deepspeed.moe and deepspeed.utils.groups' expert groups) is not implemented "
        "in dsrun, which would average their gradients over every data-parallel rank like a "
        "dense parameter's. Train them as dense parameters (delete the allreduce attribute, "
        "or set it True), or train the model with DeepSpeed")


def _named(value: Any) -> str:
    return getattr(value, "__qualname__", None) or type(value).__name__


def _checked_scheduler(scheduler: Any, given: str) -> Any:
    """``scheduler`` if it can be stepped (or None: no scheduler, as in
    DeepSpeed); a string, number or dict would fail only at the first
    engine.step() ('str' object has no attribute 'step')."""
    if scheduler is None or callable(getattr(scheduler, "step", None)):
        return scheduler
    raise DsrunConfigError(
        f"{given} {type(scheduler).__name__} {scheduler!r:.80}, not an LR scheduler: pass "
        "a scheduler object (with step()), a scheduler class or a callable that takes the "
        "optimizer and returns one; a scheduler named by a string belongs in the config's "
        '"scheduler" section')


class EngineSetup:
    """Mixed into the engine: builds its gradient sync, optimizers and
    scheduler from ``config``, ``module`` and ``precision``."""

    config: DsrunConfig
    module: torch.nn.Module
    precision: FullPrecision
    optimizer: Any
    zero_stage: int
    dp_world_size: int
    dp_group: Any
    device: torch.device
    global_rank: int
    client_lr_scheduler: Any
    mpu: Any
    _grad_sync: Optional[GradSync]
    _backward_allreduce: bool
    #: stage 0: watches the optimizer for parameters added after initialize()
    _added_params: Optional[AddedParams] = None

    def _make_grad_sync(self) -> Optional[GradSync]:
        """The stage-0 reduction: at world size > 1, or at 1 when there are
        sparse gradients (coalesced as DeepSpeed does, :mod:`sparse_grads`)."""
        sparse_ids = {id(p) for _, p in sparse_grad_params(self.module)}
        params = self.precision.params
        sparse = [p for p in params if id(p) in sparse_ids]
        if self.dp_world_size == 1 and not sparse:
            return None
        refuse_in_16_bits(self.module, self.precision, self.config.source)
        dense = [p for p in params if id(p) not in sparse_ids]
        if self.dp_world_size == 1:
            dense = []  # nothing to average
        comm = self.config.communication_data_type
        comm_dtype = torch_dtype(comm) if comm else None
        elements = bucket_elements(self.config)
        size = (comm_dtype or (params[0].dtype if params else torch.float32)).itemsize
        bucket_bytes = elements * size if elements else DEFAULT_BUCKET_BYTES
        predivide = self.config.gradient_predivide_factor
        names = dict(zip(map(id, params), self.precision.names))
        bucketed = [p for p in dense if p.requires_grad]
        return GradSync(bucketed, group=self.dp_group, bucket_bytes=bucket_bytes,
                        comm_dtype=comm_dtype, predivide=0.0 if predivide == 1.0 else predivide,
                        names=[names[id(p)] for p in bucketed],
                        late=[p for p in dense if not p.requires_grad], sparse=sparse)

    def _make_optimizer(self, client: Any, model_parameters: Optional[Iterable[Any]]
                        ) -> Optional[Optimizer]:
        if client is not None and self.config.optimizer is not None:
            log.warning("an optimizer was passed to initialize() and the config has an "
                        "\"optimizer\" section; using the client's (as DeepSpeed does)")
        self._link_model_parallel()
        built = self._build_optimizer(client, model_parameters)
        # stage 3 checks its own groups; an optimizer already stepping for a
        # ZeRO engine holds that one's partitions: wrap_optimizer says so
        taken = self.zero_stage > 0 and getattr(built, TAKEN_OVER, False)
        if built is not None and self.zero_stage < 3 and not taken:
            check_optimizer_params(built, self.module, self.precision, self.zero_stage)
        if built is not None:
            # DeepSpeed drops param groups without parameters (get_lr() has none for them)
            _check_droppable(built, client, self.client_lr_scheduler)
            built.param_groups[:] = [g for g in built.param_groups if len(g["params"])]
            if self.zero_stage == 0:
                # frozen parameters in the optimizer: they train once unfrozen, as with torch
                self.precision.track(self.module, built)
                self._added_params = AddedParams(self, built)
        return built

    def _adopt_added_params(self, at_step: bool = False) -> None:
        """Stage 0, before a backward and a step: cover parameters put into
        the optimizer since (:mod:`added_params`); at a step, reduce the
        gradients of those added after the backward's reduction ran."""
        if self._added_params is None:
            return
        if at_step:
            self._added_params.before_step(reduce_now=self._backward_allreduce)
        else:
            self._added_params.backward_started()

    def _link_model_parallel(self) -> None:
        """An mpu of model-parallel size > 1: the stage-0 step reduces its norm
        over the model-parallel group too (the ZeRO optimizers get the group
        in :meth:`_make_zero_optimizer`); what dsrun does not do for it yet
        is said now rather than at the first save."""
        self.precision.model_parallel = mp = model_parallel_of(self.mpu)
        if mp is not None and self.global_rank == 0:
            log.warning("model-parallel size %d from the mpu: gradient norms, clipping and "
                        "overflow checks are reduced over its model-parallel group too "
                        "(tensor-parallel parameters counted on every rank, replicated ones "
                        "once); save_checkpoint()/load_checkpoint() are not implemented for "
                        "model parallelism in dsrun yet and refuse", mp.size)

    def _build_optimizer(self, client: Any, model_parameters: Optional[Iterable[Any]]
                         ) -> Optional[Optimizer]:
        if isinstance(client, Optimizer):
            self.precision.adopt(client)
            return client
        source = self.module.parameters() if model_parameters is None else model_parameters
        params = self.precision.optimizer_params(source)
        if client is not None:
            if not callable(client):
                raise DsrunConfigError(f"optimizer= must be a torch.optim.Optimizer or a callable "
                                       f"taking parameters, got {type(client).__name__}")
            built = client(params)
            if not isinstance(built, Optimizer):
                raise DsrunConfigError("the optimizer callable passed to initialize() returned "
                                       f"{type(built).__name__}, not a torch.optim.Optimizer")
            return built
        if self.config.optimizer is None:
            return None
        return build_optimizer(self.config.optimizer, params)

    def _make_zero_optimizer(self) -> Any:
        """The ZeRO optimizer over the client's; at stage 3 without one, the
        partitioning alone (DeepSpeed's ZeRO-Offload engine: reference and
        EMA models, evaluation), which refuses backward and step."""
        if self.optimizer is None and self.zero_stage != 3:
            raise DsrunConfigError(
                f"ZeRO stage {self.zero_stage} needs an optimizer: add an \"optimizer\" "
                f"section to {self.config.source} or pass optimizer= to initialize()")
        self._check_unsupported()
        refuse_at_zero(self.module, self.zero_stage, self.config.source)
        if self.optimizer is not None:
            check_tested_optimizer(type(self.optimizer), self.zero_stage,
                                   self.config.zero_allow_untested_optimizer, self.config.source)
        comm = self.config.communication_data_type
        return wrap_optimizer(self.optimizer, self.config.zero_optimization,
                              self.zero_stage, self.dp_group, self.module,
                              self._zero_accumulation(), self.device,
                              loss_scaler=self.precision.scaler,
                              comm_dtype=torch_dtype(comm) if comm else None,
                              model_parallel=model_parallel_of(self.mpu))

    def _zero_accumulation(self) -> int:
        """The micro-steps per optimizer step ZeRO plans for (with 1, stage 1
        also reduces during backward)."""
        return self.config.gradient_accumulation_steps

    def _check_unsupported(self) -> None:
        """ZeRO++ features change what is computed: refuse them when on,
        rather than train without them (MiCS, removed in DeepSpeed 0.19.8,
        is refused by the config: config_passthrough.REMOVED_ZERO_KEYS)."""
        zc = self.config.zero_optimization
        enabled = [name for name, on in (
            ("zero_quantized_weights", zc.zero_quantized_weights),
            ("zero_quantized_nontrainable_weights", zc.zero_quantized_nontrainable_weights),
            ("zero_quantized_gradients", zc.zero_quantized_gradients),
            ("zero_hpz_partition_size", zc.zero_hpz_partition_size > 1)) if on]
        if enabled:
            raise DsrunConfigError(f"zero_optimization.{enabled[0]} (ZeRO++) is not "
                                   f"implemented in dsrun ({self.config.source}): remove it")

    def _check_offload(self) -> None:
        """offload_* sections: "nvme" is refused, sections a stage ignores are
        warned about, "cpu" on CPU ranks is reported as a no-op (the state
        is in host memory already); the ZeRO optimizers read the rest."""
        for level, text in offload_notes(self.config.zero_optimization, self.zero_stage,
                                         self.device, self.config.source):
            log.log(level, "%s", text)

    def _make_scheduler(self, client: Any) -> Any:
        """The client's scheduler (a callable is called with the torch
        optimizer that steps: at ZeRO stages the client's own object, which
        the ZeRO optimizer keeps - so a scheduler built over it needs no
        re-pointing), else the config's; a scheduler whose ``step()`` needs a
        metric is left to the script (:func:`~.lr_schedules.scheduler_step_args`)."""
        scheduler = self._pick_scheduler(client)
        reason = needs_lr_kwargs(scheduler)  # said now, not at the first step
        if reason and self.is_pipe_parallel:  # train_batch() takes no lr_kwargs
            raise DsrunConfigError(f"lr_scheduler: a pipeline's train_batch() steps it without "
                                   f"arguments, but {reason}")
        if reason and self.global_rank == 0:
            log.warning("lr_scheduler: every engine.step() must pass lr_kwargs: %s", reason)
        if self.global_rank != 0:
            return scheduler
        if needs_metric(scheduler):
            log.info("lr_scheduler %s: its step() needs a metric, so engine.step() does not "
                     "step it; call engine.lr_scheduler.step(metric) after each evaluation "
                     "(as Hugging Face's Trainer does), or pass engine.step(lr_kwargs=...)",
                     type(scheduler).__name__)
        elif takes_an_argument(scheduler):
            log.info("lr_scheduler %s: its step() takes an argument, so engine.step() "
                     "without lr_kwargs passes train_batch_size (%d), as DeepSpeed does for "
                     "Megatron's step(increment)", type(scheduler).__name__,
                     self.config.train_batch_size)
        return scheduler

    def _pick_scheduler(self, client: Any) -> Any:
        if client is not None:
            if self.config.scheduler is not None:
                log.warning("an lr_scheduler was passed to initialize() and the config has a "
                            "\"scheduler\" section; using the client's (as DeepSpeed does)")
            if isinstance(client, type) or (callable(client) and not hasattr(client, "step")):
                # DeepSpeed calls the factory (a scheduler class too:
                # ConstantLR) with the torch optimizer; at ZeRO stages that is
                # the inner one, whose param_groups step
                inner = self.optimizer.optimizer if self.zero_stage > 0 else self.optimizer
                return _checked_scheduler(client(inner),
                                          f"lr_scheduler={_named(client)}(optimizer) returned")
            return _checked_scheduler(client, "lr_scheduler= is")
        if self.config.scheduler is None and self.config.scheduler_error is None:
            return None
        if self.optimizer is None or self._partition_only:
            # as DeepSpeed: no optimizer, no scheduler (evaluation engines)
            if self.config.scheduler_error is not None:
                log.warning("the config's scheduler section is not used (the engine has no "
                            "optimizer), and it would be refused: %s",
                            self.config.scheduler_error)
            else:
                log.info("the config (%s) has a scheduler section but the engine has no "
                         "optimizer: no LR scheduler is built", self.config.source)
            return None
        if self.config.scheduler_error is not None:
            raise DsrunConfigError(self.config.scheduler_error)
        return build_scheduler(self.config.scheduler, self.optimizer)
