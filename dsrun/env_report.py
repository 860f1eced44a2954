"""DeepSpeed's ``deepspeed.env_report`` (its ``ds_report`` command), which
training scripts call at start-up to log the environment: ``main()`` prints
what this rank runs on. dsrun has no compiled operators, so the operator
table says so in one line instead of listing build statuses; ``dsrun
doctor`` checks the hosts of a job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

_DOTS = 33


def _shm_size() -> str:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError as exc:
        return f"unknown ({exc.strerror})"
    return f"{usage.total / 2**30:.1f} GiB"


def env_lines() -> list[tuple[str, str]]:
    """(name, value) rows of the report, DeepSpeed's names where it has them."""
    import torch

    import dsrun
    from dsrun.accelerator import get_accelerator

    rows = [("torch install path", str(list(torch.__path__))),
            ("torch version", torch.__version__),
            ("deepspeed install path", str(list(dsrun.__path__))),
            ("deepspeed info", f"{dsrun.__version__} (dsrun {dsrun.DSRUN_VERSION})"),
            ("accelerator", get_accelerator().device_name())]
    if torch.cuda.is_available():
        rows += [("torch cuda version", str(torch.version.cuda)),
                 ("torch hip version", str(getattr(torch.version, "hip", None))),
                 ("cuda devices", str(torch.cuda.device_count()))]
    rows += [("python version", sys.version.split()[0]),
             ("shared memory (/dev/shm) size", _shm_size()),
             ("dsrun launcher rank", os.environ.get("RANK", "not under a launcher"))]
    return rows


def op_report(verbose: bool = True) -> None:
    """DeepSpeed's operator table; dsrun compiles none (its ops are torch code)."""
    print("DeepSpeed C++/CUDA extension op report: none - dsrun's optimizers and kernels "
          "are torch code, nothing to build")


def debug_report() -> None:
    print("DeepSpeed general environment info:")
    for name, value in env_lines():
        print(name, "." * max(1, _DOTS - len(name)), value)


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the report, as ``ds_report`` does (the arguments as DeepSpeed's)."""
    if not hide_operator_status:
        op_report(verbose=not hide_errors_and_warnings)
    debug_report()


def cli_main() -> None:
    parser = argparse.ArgumentParser(description="the environment dsrun's ranks run in")
    parser.add_argument("--hide_operator_status", action="store_true")
    parser.add_argument("--hide_errors_and_warnings", action="store_true")
    args = parser.parse_args()
    main(args.hide_operator_status, args.hide_errors_and_warnings)


if __name__ == "__main__":
    cli_main()
