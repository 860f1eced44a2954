"""DeepSpeed's ``zero_to_torch``: a dsrun checkpoint's weights in fp32, fp16 or bf16.

DeepSpeed 0.19.8's second recovery script, the command line of
:mod:`.zero_to_fp32` with a required ``--dtype``::

    python -m dsrun.utils.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR
        --dtype {bf16,bfloat16,float16,float32,fp16,fp32} [-t TAG]
        [--max_shard_size 5GB] [--safe_serialization] [--exclude_frozen_parameters]

Floating-point tensors are written in that dtype (from the fp32 masters),
integer buffers keep theirs; the files are :mod:`.zero_to_fp32`'s. Under
``import dsrun as deepspeed`` it is ``deepspeed.utils.zero_to_torch``, and a
save leaves ``SAVE_DIR/zero_to_torch.py`` that runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Optional

from dsrun.utils.zero_to_fp32 import (
    OUTPUT_DTYPE_NAMES,
    arguments,
    convert_zero_checkpoint_to_state_dict,
    run,
)

__all__ = ["OUTPUT_DTYPE_NAMES", "convert_zero_checkpoint_to_state_dict", "main"]


def main(args: Optional[Sequence[str]] = None) -> int:
    """``python -m dsrun.utils.zero_to_torch`` (module docstring): 0, or 1
    with the error on stderr."""
    parser = arguments("python -m dsrun.utils.zero_to_torch",
                       "Write a dsrun checkpoint's weights as a plain state dict in float32, "
                       "float16 or bfloat16 (DeepSpeed's zero_to_torch.py).", dtype=True)
    parsed = parser.parse_args(args)
    return run(parsed, OUTPUT_DTYPE_NAMES[parsed.dtype])


if __name__ == "__main__":
    sys.exit(main())
