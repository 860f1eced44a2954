"""``deepspeed.ops.lamb``'s :class:`FusedLamb` with DeepSpeed's constructor
arguments, :class:`dsrun.runtime.optimizers.Lamb` underneath (its docstring
has the arithmetic, which is FusedLamb's kernel's). Nothing is compiled; it
steps parameters on any device.

``max_grad_norm``: DeepSpeed's FusedLamb clips only with gradient norms
its own fp16 optimizer hands to ``step``; called by a script it fails at
the first step when ``max_grad_norm`` > 0. Here anything but 0 is an error
at construction that names ``gradient_clipping``, which clips the global
norm before every optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dsrun.errors import DsrunConfigError
from dsrun.runtime.optimizers import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        if max_grad_norm:
            raise DsrunConfigError(f"FusedLamb(max_grad_norm={max_grad_norm}) is not supported: "
                                   'clip with the config\'s "gradient_clipping"')
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                         max_coeff=max_coeff, min_coeff=min_coeff, amsgrad=amsgrad)
