"""What each rank saves of its own: RNG states and the dataloader position.

* :func:`capture_rng` / :func:`restore_rng`: Python's ``random``, numpy's
  global generator (when numpy is installed), torch's CPU generator and
  every CUDA device's (when CUDA is available), as JSON (byte states in
  base64). Restoring on the rank that saved them makes dropout and data
  augmentation continue exactly as they would have.
* :func:`loader_state` / :func:`restore_loader`: the position of the
  engine's dataloader (anything with ``state_dict``/``load_state_dict``,
  e.g. :class:`~dsrun.runtime.dataloader.DsrunDataLoader`), so that the next
  batch after a resume is the one that would have come next. Loaded at
  another data-parallel size, the position is converted through the number
  of samples consumed in the epoch.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Mapping
from typing import Any, Optional

import torch

log = logging.getLogger("dsrun.runtime.checkpoint")


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(state), gauss],
                           "torch": _b64(torch.get_rng_state())}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    if "python" in state:
        version, values, gauss = state["python"]
        random.setstate((version, tuple(values), gauss))
    if "torch" in state:
        torch.set_rng_state(_tensor(state["torch"]))
    if "numpy" in state:
        try:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            log.warning("the checkpoint has numpy's RNG state but numpy is not installed")
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_tensor(s) for s in cuda])
        else:
            log.warning("the checkpoint has CUDA RNG states of %d devices, this rank sees %d: "
                        "not restored", len(cuda), torch.cuda.device_count())


def loader_state(loader: Any, dp_world: int) -> Optional[dict[str, Any]]:
    if loader is None or not callable(getattr(loader, "state_dict", None)):
        return None
    return {"state": loader.state_dict(), "dp_world": dp_world}


def restore_loader(loader: Any, saved: Optional[Mapping[str, Any]], dp_world: int) -> None:
    if saved is None:
        return
    if loader is None or not callable(getattr(loader, "load_state_dict", None)):
        log.warning("the checkpoint has a dataloader position but the engine's dataloader "
                    "cannot take it (no load_state_dict): the data restarts from its beginning")
        return
    state = dict(saved["state"])
    if saved.get("dp_world") != dp_world and "batch" in state:
        rescale = getattr(loader, "rescale_state", None)
        if callable(rescale):
            state = rescale(state, int(saved["dp_world"]), dp_world)
    loader.load_state_dict(state)
