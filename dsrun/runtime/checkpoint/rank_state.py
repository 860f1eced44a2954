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
  another data-parallel or micro-batch size, the position is converted
  through the number of samples consumed in the epoch; a position of another
  dataset (its length differs) is not restored.
* :func:`unsaved_loaders`: the training loaders whose position a save
  leaves out, to warn of (``deepspeed_io`` loaders only once the engine
  trained from them: not an evaluation loader).
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Iterable, Mapping
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


def unsaved_loaders(training: Any, built: Iterable[Any]) -> list[str]:
    """What to warn of at a save: the engine's dataloader ``training`` when
    its position cannot be saved (a DataLoader given to ``initialize`` as
    is), and each loader of ``built`` (``deepspeed_io(route="train")``'s)
    that is not ``training`` (only the engine's dataloader is saved) and
    that the engine trained from (its ``trained``: a step came between one
    of its batches and the next; an evaluation loader built with
    DeepSpeed's default route has none, and is not warned of). A loader of
    ``built`` without ``trained`` (a torch DataLoader, built with a sampler
    or workers) is named as one that may be trained from."""
    found = []
    if training is not None and not callable(getattr(training, "state_dict", None)):
        found.append(f"the engine's dataloader is a {type(training).__name__} given to "
                     "initialize(training_data=) as it is: its data position is not saved, "
                     "a resumed run starts its epoch again at the first batch (pass the "
                     "Dataset to have dsrun build a loader whose position is saved)")
    for loader in built:
        if loader is training:
            continue
        if not hasattr(loader, "trained"):  # a torch DataLoader: used how is not known
            found.append(f"a {type(loader).__name__} built by engine.deepspeed_io("
                         "route='train') with a data_sampler or num_local_io_workers: dsrun "
                         "saves no position for it; if the engine trains from it, a resumed "
                         "run starts its epoch again at the first batch (build it without "
                         "those, as engine.training_dataloader, to have its position saved)")
        elif loader.trained:
            found.append(f"a {type(loader).__name__} built by engine.deepspeed_io() is not "
                         "engine.training_dataloader: its data position is not saved, a "
                         "resumed run starts its epoch again at the first batch (assign "
                         "engine.training_dataloader = loader to have it saved)")
    return found


def restore_loader(loader: Any, saved: Optional[Mapping[str, Any]], dp_world: int,
                   announce: bool = False) -> Optional[Mapping[str, Any]]:
    """Put ``loader`` at the ``saved`` position (the loader's
    ``load_state_dict`` converts one of another data-parallel size or
    micro-batch size through the samples consumed); returns the
    position it continues at, or None when none was restored. ``announce``
    (rank 0): log that position, or why none was restored."""
    if saved is None:
        return None
    if loader is None or not callable(getattr(loader, "load_state_dict", None)):
        log.warning("the checkpoint has a dataloader position but the engine's dataloader "
                    "cannot take it (no load_state_dict): the data restarts from its beginning")
        return None
    state = dict(saved["state"])
    check = getattr(loader, "state_problem", None)
    problem = check(state) if callable(check) else None
    if problem is not None:
        if announce:
            log.warning("the checkpoint's dataloader position is not restored: %s (another "
                        "dataset); the dataloader starts at its first batch", problem)
        return None
    if "batch" in state and "num_replicas" not in state:
        # saved before the state recorded its replicas: the record's dp_world
        # counts them (the loader's load_state_dict converts the position)
        state["num_replicas"] = int(saved.get("dp_world", dp_world))
    loader.load_state_dict(state)
    now = loader.state_dict()
    if announce:
        log.info("dataloader: continues at epoch %s, batch %s of %s (the checkpoint's data "
                 "position; a script that skips to its own position after a load skips "
                 "twice: set \"checkpoint\": {\"load_data_position\": false})",
                 now.get("epoch"), now.get("batch"), _length(loader))
    return now


def _length(loader: Any) -> Any:
    try:
        return len(loader)
    except TypeError:
        return "?"
