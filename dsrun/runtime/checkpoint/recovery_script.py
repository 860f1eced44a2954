"""``SAVE_DIR/zero_to_fp32.py`` and ``zero_to_torch.py``, the scripts beside the tags.

DeepSpeed 0.19.8 copies its ``zero_to_fp32.py`` and ``zero_to_torch.py``
into every save directory and makes them executable, and scripts and people
expect to find them there. dsrun's are a few lines that run
:mod:`dsrun.utils.zero_to_fp32` and :mod:`dsrun.utils.zero_to_torch` (same
options); rank 0 writes them as the last step of a commit
(:class:`~.writer.Commit`), and a failure to write one never fails the save.
"""

from __future__ import annotations

import logging
import os
import stat

from dsrun.runtime.checkpoint.storage import atomic_write

log = logging.getLogger("dsrun.runtime.checkpoint")

RECOVERY_SCRIPT = "zero_to_fp32.py"
TORCH_SCRIPT = "zero_to_torch.py"
_TEXT = '''#!/usr/bin/env python
"""The checkpoints in this directory as a plain {what} state dict (written by
dsrun's save_checkpoint, where DeepSpeed copies its {script}):

    python {script} CHECKPOINT_DIR OUTPUT_DIR {dtype}[-t TAG] [--safe_serialization]
        [--max_shard_size 5GB] [--exclude_frozen_parameters]

It runs dsrun.utils.{module} (dsrun must be importable).
"""
import sys

from dsrun.utils.{module} import main

if __name__ == "__main__":
    sys.exit(main())
'''
SCRIPTS = {
    RECOVERY_SCRIPT: _TEXT.format(what="fp32", script=RECOVERY_SCRIPT, dtype="",
                                  module="zero_to_fp32").encode(),
    TORCH_SCRIPT: _TEXT.format(what="fp32, fp16 or bf16", script=TORCH_SCRIPT,
                               dtype="--dtype bf16 ", module="zero_to_torch").encode(),
}


def _write(path: str, text: bytes) -> None:
    try:
        with open(path, "rb") as f:
            same = f.read() == text
    except OSError:
        same = False
    if not same:
        atomic_write(path, text, durable=False)
    mode = os.stat(path).st_mode
    if not mode & stat.S_IXUSR:  # executable, as DeepSpeed's copies
        os.chmod(path, mode | stat.S_IXUSR)


def write_recovery_script(save_dir: str) -> None:
    """``SAVE_DIR/zero_to_fp32.py`` and ``zero_to_torch.py`` (the commit's
    last step, rank 0), left alone when they already hold this text; a
    failure to write one is logged, the checkpoint stands."""
    for name, text in SCRIPTS.items():
        path = os.path.join(save_dir, name)
        try:
            _write(path, text)
        except OSError as exc:
            log.warning("could not write %s: %s (the checkpoint is complete)", path, exc)
