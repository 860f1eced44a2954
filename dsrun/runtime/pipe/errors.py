"""The errors a pipeline raises, each also an instance of the built-in class
DeepSpeed 0.19.8 raises for the same misuse.

A DeepSpeed script that guards a call with ``except RuntimeError`` (or
``AssertionError``, ``NotImplementedError``, ``TypeError``) still catches
dsrun's error, which keeps its own message (the bad value and where it came
from) and stays a :class:`~dsrun.errors.DsrunError`. Pure: no torch.
"""

from __future__ import annotations

from dsrun.errors import DsrunConfigError, DsrunError


class PipelineError(DsrunError):
    """A pipeline used in a way it cannot work (DeepSpeed's name, also a
    :class:`~dsrun.errors.DsrunError`): ``engine.backward()`` or
    ``engine.step()`` on a pipeline engine."""


class PipeRuntimeError(DsrunError, RuntimeError):
    """A pipeline call made in a state it cannot run in, where DeepSpeed
    raises ``RuntimeError`` (``train_batch()`` under ``torch.no_grad()``, a
    loss that is not a scalar)."""


class PipeConfigRuntimeError(DsrunConfigError, RuntimeError):
    """A pipeline described wrongly, where DeepSpeed raises ``RuntimeError``
    (a ``LayerSpec`` of a class that is not a module, no ``num_stages`` or
    ``topology``, a layer type no layer matches)."""


class PipeAssertionError(DsrunConfigError, AssertionError):
    """A bad argument DeepSpeed refuses with an ``assert`` (a topology of
    another world size, a negative checkpoint interval, ZeRO stage 3)."""


class PipeNotImplementedError(DsrunConfigError, NotImplementedError):
    """Something DeepSpeed raises ``NotImplementedError`` for (the
    ``"profile"`` partition method, an ``eval_batch`` reduction other than
    ``"avg"``, a stage output that is not tensors)."""


class PipeTypeError(DsrunConfigError, TypeError):
    """An argument of the wrong kind, where DeepSpeed fails with
    ``TypeError`` (a list as a data iterator, a ``LayerSpec`` of a function)."""


class PipeValueError(DsrunConfigError, ValueError):
    """A pipeline that cannot train as laid out, where DeepSpeed fails with
    ``ValueError`` (a stage without trainable parameters: torch's empty
    parameter list for the optimizer)."""
