"""``SAVE_DIR/zero_to_fp32.py``: the script a commit leaves next to the tags.

DeepSpeed copies its ``zero_to_fp32.py`` into every save directory, and
scripts and people expect to find it there. dsrun's is a few lines that run
:mod:`dsrun.utils.zero_to_fp32` (same options); rank 0 writes it as the
last step of a commit (:class:`~.writer.Commit`), and a failure to write it
never fails the save.
"""

from __future__ import annotations

import logging
import os

from dsrun.runtime.checkpoint.storage import atomic_write

log = logging.getLogger("dsrun.runtime.checkpoint")

RECOVERY_SCRIPT = "zero_to_fp32.py"
_RECOVERY_TEXT = b'''#!/usr/bin/env python
"""The checkpoints in this directory as a plain fp32 state dict (written by
dsrun's save_checkpoint, where DeepSpeed copies its zero_to_fp32.py):

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
        [--max_shard_size 5GB] [--exclude_frozen_parameters]

It runs dsrun.utils.zero_to_fp32 (dsrun must be importable).
"""
import sys

from dsrun.utils.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


def write_recovery_script(save_dir: str) -> None:
    """``SAVE_DIR/zero_to_fp32.py`` (the commit's last step, rank 0), left
    alone when it is already this text; a failure to write it is logged,
    the checkpoint stands."""
    path = os.path.join(save_dir, RECOVERY_SCRIPT)
    try:
        with open(path, "rb") as f:
            if f.read() == _RECOVERY_TEXT:
                return
    except OSError:
        pass
    try:
        atomic_write(path, _RECOVERY_TEXT, durable=False)
    except OSError as exc:
        log.warning("could not write %s: %s (the checkpoint is complete)", path, exc)
