"""DeepSpeed's flops profiler (``deepspeed.profiling.flops_profiler``).

Counts the floating-point operations, multiply-accumulates, parameters and
forward latency of a model and each of its modules, and prints DeepSpeed's
three-part report (summary, top modules per depth, module tree)::

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(batch)
    prof.stop_profile()
    prof.print_model_profile(profile_step=1)
    prof.end_profile()

    flops, macs, params = get_model_profile(model, input_shape=(8, 512))

or through the engine with the ``flops_profiler`` config section, which
profiles one whole optimizer step on global rank 0
(:mod:`dsrun.profiling.engine_step`).

While profiling, each module carries DeepSpeed's ``__flops__``,
``__macs__``, ``__params__`` and ``__duration__``, read by
``get_module_flops`` / ``get_module_macs`` / ``get_module_duration``
(:mod:`dsrun.profiling.module_attrs`).

How it counts: a ``TorchDispatchMode`` sees every aten op the model runs
(after autograd and after composite ops decompose), whatever calls it -
modules, ``torch.nn.functional``, tensor methods, ``@`` - and
:func:`~dsrun.profiling.counting.op_cost` prices it from shapes. Module
forward hooks (pre-hooks placed first, so a ZeRO stage 3 gather is inside
its module's time) keep a stack that tells which module an op belongs to.
Ops outside the model's forward are not counted, as in DeepSpeed, except in
the engine's backward, which is counted as a whole.

Latency: perf_counter around each module's forward (synchronising CUDA at
both ends when CUDA is in use), minus the time the counting itself took
(measured per op), so the report shows what the model costs, not what
profiling it costs; a few microseconds per op of dispatch into Python
remain in it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsrun.profiling import module_attrs
from dsrun.profiling.counting import op_cost
from dsrun.profiling.module_attrs import get_module_duration, get_module_flops, get_module_macs
from dsrun.profiling.tree import (
    ModuleStats,
    Summary,
    aggregated_lines,
    detailed_lines,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    summary_lines,
)

__all__ = [
    "FlopsProfiler", "get_model_profile", "get_module_duration", "get_module_flops",
    "get_module_macs", "duration_to_string", "flops_to_string", "macs_to_string",
    "number_to_string", "params_to_string",
]

# DeepSpeed's banner and summary line, word for word: logs are grepped for them
_HEADER = "-------------------------- DeepSpeed Flops Profiler --------------------------"
_FOOTER = "-" * len(_HEADER)
_NOTATION = (
    "Notations: number of parameters (params), multiply-accumulate operations (MACs),\n"
    "floating-point operations (flops), floating-point operations per second (FLOPS),\n"
    "fwd latency (forward), bwd latency (backward), step (optimizer step),\n"
    "iter latency (fwd + bwd + step). Counts are per rank; a module's include its children's.")


def _param_count(module: torch.nn.Module) -> int:
    # ZeRO stage 3 parameters hold a shard: ds_numel is the whole parameter
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


def synchronize_cuda() -> None:
    """Wait for queued CUDA work (where CUDA is in use), so that a time
    taken next covers it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Counter(TorchDispatchMode):
    """Prices every op and hands the cost to the profiler."""

    def __init__(self, profiler: FlopsProfiler) -> None:
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        started = time.perf_counter()
        flops, macs = op_cost(func, args, kwargs, out)
        if flops or macs:
            self.profiler._charge(flops, macs)
        self.profiler._overhead += time.perf_counter() - started
        return out


class FlopsProfiler:
    """Measures a model's flops, MACs, parameters and forward latency per
    module (module docstring). ``ds_engine`` (set by the engine) adds the
    step's backward and optimizer-step figures to the summary."""

    def __init__(self, model: torch.nn.Module, ds_engine: Any = None,
                 recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor  # unused: backward is counted
        self.started = False
        self._root: Optional[ModuleStats] = None
        self._by_module: dict[int, ModuleStats] = {}
        self._modules: list[torch.nn.Module] = []
        self._handles: list[Any] = []
        self._stack: list[tuple[ModuleStats, float, float]] = []
        self._mode: Optional[_Counter] = None
        self._phase: Optional[str] = None
        self._overhead = 0.0
        self.backward_flops = 0
        self.backward_macs = 0

    # --------------------------------------------------------- control

    def start_profile(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        """Install the hooks, reset the counts and start counting (modules
        whose type is in ``ignore_list`` get no entry: what they run counts
        toward the enclosing module)."""
        if self.started:
            self.stop_profile()
        self._build(tuple(ignore_list or ()))
        self._resume("forward")

    def stop_profile(self) -> None:
        """Stop counting and remove the hooks; the counts stay readable."""
        self._pause()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.started = False

    def reset_profile(self) -> None:
        """Zero every count (the module tree stays)."""
        if self._root is not None:
            for _, stats in self._root.walk():
                stats.own_flops = stats.own_macs = stats.calls = 0
                stats.duration = 0.0
            module_attrs.reset(self.model, _param_count)
        self.backward_flops = self.backward_macs = 0
        self._overhead = 0.0

    def end_profile(self) -> None:
        """Stop and forget everything measured (and remove DeepSpeed's
        per-module attributes, :mod:`~dsrun.profiling.module_attrs`)."""
        self.stop_profile()
        if self._root is not None:
            module_attrs.remove(self.model)
        self._root = None
        self._by_module.clear()
        self._modules.clear()

    @contextlib.contextmanager
    def counting(self, phase: str) -> Iterator[None]:
        """Count what runs inside (``"forward"``: per module; ``"backward"``:
        into :attr:`backward_flops`), with the hooks installed."""
        self._resume(phase)
        try:
            yield
        finally:
            self._pause()

    # --------------------------------------------------------- results

    def get_total_flops(self, as_string: bool = False) -> Any:
        flops = self._root.flops if self._root else 0
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> Any:
        macs = self._root.macs if self._root else 0
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> Any:
        params = self._root.params if self._root else _param_count(self.model)
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> Any:
        """The model's forward latency while profiling, in seconds."""
        duration = self._root.latency if self._root else 0.0
        return duration_to_string(duration) if as_string else duration

    def module_stats(self) -> Optional[ModuleStats]:
        """The measured tree (``None`` before :meth:`start_profile`)."""
        return self._root

    def profile_text(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                     detailed: bool = True, summary: Optional[Summary] = None) -> str:
        """The report :meth:`print_model_profile` prints."""
        if self._root is None:
            raise RuntimeError("nothing was profiled: call start_profile() and run the model "
                               "before printing the profile")
        summary = summary or self._forward_summary(profile_step)
        lines = [_HEADER, f"Profile Summary at step {summary.step}:", _NOTATION, "",
                 *summary_lines(summary), "", "----- aggregated profile per rank -----",
                 *aggregated_lines(self._root, module_depth, top_modules)]
        if detailed:
            lines += ["", "----- detailed profile per rank -----",
                      *detailed_lines(self._root, module_depth)]
        lines.append(_FOOTER)
        return "\n".join(lines) + "\n"

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1,
                            top_modules: int = 1, detailed: bool = True,
                            output_file: Optional[str] = None,
                            summary: Optional[Summary] = None) -> None:
        """Print the report, or write it to ``output_file``."""
        text = self.profile_text(profile_step, module_depth, top_modules, detailed, summary)
        if output_file:
            with open(output_file, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1
                                       ) -> None:
        if self._root is None:
            raise RuntimeError("nothing was profiled: call start_profile() first")
        sys.stdout.write("\n".join(aggregated_lines(self._root, module_depth, top_modules)) + "\n")
        sys.stdout.flush()

    # -------------------------------------------------------- internals

    def _forward_summary(self, step: int) -> Summary:
        assert self._root is not None
        return Summary(step=step, world_size=_world_size(), dp_size=_world_size(),
                       micro_batches=max(self._root.calls, 1), samples=0,
                       params=self._root.params, fwd_flops=self._root.flops,
                       fwd_macs=self._root.macs, bwd_flops=self.backward_flops,
                       fwd_latency=self._root.latency, bwd_latency=None, step_latency=None)

    def _build(self, ignore: tuple[type, ...]) -> None:
        self._by_module.clear()
        self._modules.clear()
        self._overhead = 0.0
        self.backward_flops = self.backward_macs = 0
        self._root = self._stats_for("", self.model)
        self._attach(self.model, self._root, ignore)
        module_attrs.reset(self.model, _param_count)  # DeepSpeed's, on every module

    def _stats_for(self, name: str, module: torch.nn.Module) -> ModuleStats:
        stats = ModuleStats(name=name, kind=type(module).__name__, params=_param_count(module),
                            extra=module.extra_repr())
        self._by_module[id(module)] = stats
        self._modules.append(module)
        return stats

    def _install_hooks(self) -> None:
        _warm_up_dispatch()
        for module in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._pre_hook, prepend=True))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        self.started = True

    def _attach(self, module: torch.nn.Module, parent: ModuleStats, ignore: tuple[type, ...]
                ) -> None:
        for child_name, child in module.named_children():
            name = f"{parent.name}.{child_name}" if parent.name else child_name
            if id(child) in self._by_module:  # shared: counted where it first appears
                continue
            if ignore and isinstance(child, ignore):
                self._attach(child, parent, ignore)
                continue
            stats = self._stats_for(name, child)
            parent.children.append(stats)
            self._attach(child, stats, ignore)

    def _resume(self, phase: str) -> None:
        if self._root is None:
            self._build(())
        if not self._handles:
            self._install_hooks()
        self._phase = phase
        if self._mode is None:
            self._mode = _Counter(self)
            self._mode.__enter__()

    def _pause(self) -> None:
        self._phase = None
        self._stack.clear()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _charge(self, flops: int, macs: int) -> None:
        if self._phase == "backward":
            self.backward_flops += flops
            self.backward_macs += macs
        elif self._phase == "forward" and self._stack:
            stats = self._stack[-1][0]
            stats.own_flops += flops
            stats.own_macs += macs

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self._phase != "forward":
            return  # e.g. recomputation by activation checkpointing in backward
        stats = self._by_module.get(id(module))
        if stats is not None:
            synchronize_cuda()
            self._stack.append((stats, time.perf_counter(), self._overhead))

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._phase != "forward":
            return
        stats = self._by_module.get(id(module))
        if stats is None or not any(entry[0] is stats for entry in self._stack):
            return
        synchronize_cuda()
        now = time.perf_counter()
        while self._stack:
            entry, started, overhead = self._stack.pop()
            if entry is stats:
                stats.duration += max(now - started - (self._overhead - overhead), 0.0)
                stats.calls += 1
                module_attrs.write(module, stats)
                return


def _warm_up_dispatch() -> None:
    """The first op dispatched to a Python mode imports ``torch._dynamo``
    (seconds): do that here, outside any measured forward."""
    with _Counter(FlopsProfiler(torch.nn.Identity())):
        torch.zeros(1).add_(1)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_model_profile(model: torch.nn.Module, input_shape: Optional[tuple[int, ...]] = None,
                      args: Optional[list[Any]] = None, kwargs: Optional[dict[str, Any]] = None,
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: Optional[str] = None,
                      ignore_modules: Optional[Iterable[type]] = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward (``mode="generate"``: one ``model.generate``)
    after ``warm_up`` unprofiled ones, in eval mode and without gradients
    (the model's mode is restored after); returns ``(flops, macs, params)``,
    as strings unless ``as_string=False``.

    The input is ``args``/``kwargs``, or, with ``input_shape``, one tensor
    of that shape filled with ones, of the model's parameter dtype and
    device (an integer shape for models that take token ids: pass ``args``).
    """
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    args = list(args or [])
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"input_shape must be a non-empty tuple of sizes, got {input_shape!r}")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        args = [torch.ones(input_shape, dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, args or kwargs for the model")
    run = model.generate if mode == "generate" else model  # type: ignore[operator]
    was_training = model.training
    model.eval()  # as DeepSpeed: no dropout, BatchNorm's running statistics untouched
    try:
        with torch.no_grad():
            for _ in range(warm_up):
                run(*args, **kwargs)
            prof = FlopsProfiler(model)
            prof.start_profile(ignore_list=ignore_modules)
            try:
                run(*args, **kwargs)
            finally:
                prof.stop_profile()
    finally:
        model.train(was_training)  # DeepSpeed leaves the model in eval mode
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth,
                                 top_modules=top_modules, detailed=detailed,
                                 output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
