"""Loud errors for reading a released ZeRO-3 parameter's data.

A released partitioned parameter reports its *logical* shape
(:class:`~.partitioned.ZeroParameter`) while its ``data`` is empty. Code
that takes the shape from the parameter and then works on its data would
otherwise run on the wrong sizes: the old ``torch.nn.utils.spectral_norm``
under ``zero.Init`` reshaped the empty weight to ``(8, 0)`` and built a
different model without an error; ``load_state_dict`` after
``initialize()`` said ``[6, 4]`` did not match ``[6, 4]``; a
``copy.deepcopy`` of the module held parameters without values.

:class:`ReleasedChecks` (mixed into ``ZeroParameter``) makes the Python
methods such code calls - ``reshape``, ``view``, ``permute``, ``expand``,
``copy_`` - raise :class:`ReleasedParameterError` naming the parameter,
that it is partitioned, and what to do instead (``copy.deepcopy``:
:mod:`~.param_copy`).

**In-place writes** (:data:`WRITES`: ``fill_``, ``zero_``, ``normal_``,
``uniform_``... - what ``torch.nn.init`` calls) on an empty tensor did
nothing, silently: under ``zero.Init``, ``nn.MultiheadAttention`` setting
its built ``out_proj.bias`` to 0 kept Linear's random bias (as in
DeepSpeed 0.19.8). While a ``zero.Init`` context is open
(:func:`building`), such a write runs on the whole parameter, gathered on
every rank, and group rank 0's result is kept
(``GatheredParameters(modifier_rank=0)``, collective - every rank builds
the same model): the values, and each rank's random-number stream, are what
plain torch gives. Outside one it is refused: a collective there could
hang a write made on one rank, and a write to the shard alone would differ
between ranks.

Only these methods are checked (one dict lookup each): torch operators on
the parameter (``F.linear``, ``torch.add(p, 1, out=p)``) still see the
empty data and fail with torch's error, and a gathered parameter - inside
a module's forward or a ``GatheredParameters`` - is not affected.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from dsrun.errors import DsrunError

__all__ = ["WRITES", "ReleasedChecks", "ReleasedParameterError", "building", "released_error",
           "set_init_write"]

# The in-place methods checked (module docstring): torch.nn.init's (trunc_normal_
# is uniform_, erfinv_, mul_, add_, clamp_) and the elementwise ones an EMA uses.
WRITES = ("fill_", "zero_", "normal_", "uniform_", "erfinv_", "mul_", "add_", "sub_", "div_",
          "clamp_", "lerp_", "addcmul_", "exponential_", "log_normal_", "cauchy_",
          "geometric_", "bernoulli_", "random_")

Write = Callable[[torch.Tensor, Callable[[], Any]], Any]
_init_write: list[Optional[Write]] = [None]


def set_init_write(write: Optional[Write]) -> None:
    """Installed by ``zero.Init`` while a context is open (None: none is):
    ``write(param, apply)`` runs ``apply()`` with ``param`` gathered and
    keeps group rank 0's result."""
    _init_write[0] = write


def building() -> bool:
    """A ``zero.Init`` context is open."""
    return _init_write[0] is not None


class ReleasedParameterError(DsrunError, RuntimeError):
    """The data of a released ZeRO-3 parameter was read outside a gather
    (a RuntimeError, as torch's shape errors it replaces)."""


_HINTS = {
    "copy": ("to load weights into the model after initialize(), use "
             "engine.load_checkpoint(), or call load_state_dict inside "
             "`with dsrun.zero.GatheredParameters(list(model.parameters()), "
             "modifier_rank=0):` on every rank"),
    "deepcopy": ("for a copy with the full values (an EMA or reference model), copy the "
                 "module inside `with dsrun.zero.GatheredParameters(list(model.parameters())):` "
                 "on every rank; for full weights on disk, engine.save_16bit_model(); for a "
                 "second partitioned model (to give to initialize()), copy it inside `with "
                 "dsrun.zero.Init():` on every rank"),
    "write": ("change it inside `with dsrun.zero.GatheredParameters([param], "
              "modifier_rank=0):` on every rank (rank 0's result is kept); on this rank's "
              "empty data the write would do nothing"),
    "read": ("read it inside `with dsrun.zero.GatheredParameters([param]):` (every rank), "
             "or with modifier_rank=0 to change it; full weights on disk: "
             "engine.save_16bit_model()"),
}


def released(param: torch.Tensor) -> bool:
    """``param`` is partitioned and its data does not hold its values now
    (not asked while dynamo traces: it cannot read a tensor's ``__dict__``,
    and a compiled forward of a stage-3 model runs only where every
    parameter is kept whole, :mod:`~.compiled`)."""
    if torch.compiler.is_compiling():
        return False
    numel = param.__dict__.get("ds_numel")
    return bool(numel) and torch.Tensor.numel(param) != numel


def released_error(param: torch.Tensor, action: str, hint: str = "read"
                   ) -> ReleasedParameterError:
    """The error for ``action`` on released ``param`` (``hint``: a key of
    ``_HINTS``, the way out); its ``what`` is the action and the parameter,
    for :mod:`~.init` to say again in its own terms."""
    name = param.__dict__.get("ds_name") or f"parameter #{param.__dict__.get('ds_id', '?')}"
    what = f"{action} {name} of shape {tuple(param.__dict__['ds_shape'])}"
    shard = param.__dict__["ds_tensor"].numel()
    err = ReleasedParameterError(
        f"{what}: it is partitioned by ZeRO stage 3 and released on this rank, which holds "
        f"only a shard of {shard} of its {param.__dict__['ds_numel']} elements (its data is "
        f"empty outside a gather); {_HINTS[hint]}")
    err.what = what  # type: ignore[attr-defined]
    return err


class ReleasedChecks:
    """The methods of ``ZeroParameter`` that refuse a released parameter
    (module docstring); the others are torch's."""

    def reshape(self, *shape: Any, **kwargs: Any) -> torch.Tensor:
        if released(self):  # type: ignore[arg-type]
            raise released_error(self, "cannot reshape")  # type: ignore[arg-type]
        return torch.Tensor.reshape(self, *shape, **kwargs)  # type: ignore[arg-type]

    def view(self, *shape: Any, **kwargs: Any) -> torch.Tensor:
        if released(self):  # type: ignore[arg-type]
            raise released_error(self, "cannot view")  # type: ignore[arg-type]
        return torch.Tensor.view(self, *shape, **kwargs)  # type: ignore[arg-type]

    def permute(self, *dims: Any, **kwargs: Any) -> torch.Tensor:
        if released(self):  # type: ignore[arg-type]
            raise released_error(self, "cannot permute")  # type: ignore[arg-type]
        return torch.Tensor.permute(self, *dims, **kwargs)  # type: ignore[arg-type]

    def expand(self, *sizes: Any, **kwargs: Any) -> torch.Tensor:
        if released(self):  # type: ignore[arg-type]
            raise released_error(self, "cannot expand")  # type: ignore[arg-type]
        return torch.Tensor.expand(self, *sizes, **kwargs)  # type: ignore[arg-type]

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if released(self):  # type: ignore[arg-type]
            raise released_error(self, "cannot copy values into", "copy")  # type: ignore
        return torch.Tensor.copy_(self, src, non_blocking)  # type: ignore[arg-type]


def _checked_write(name: str) -> Callable[..., Any]:
    """``torch.Tensor.<name>`` that, on a released parameter, writes the
    whole parameter under ``zero.Init`` or refuses (module docstring)."""
    method = getattr(torch.Tensor, name)

    def write(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not released(self):
            return method(self, *args, **kwargs)
        init_write = _init_write[0]
        if init_write is None:
            raise released_error(self, f"cannot {name}", "write")
        return init_write(self, lambda: method(self, *args, **kwargs))

    write.__name__ = write.__qualname__ = name
    write.__doc__ = method.__doc__
    return write


for _name in WRITES:
    setattr(ReleasedChecks, _name, _checked_write(_name))
