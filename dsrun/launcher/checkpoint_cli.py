"""``dsrun checkpoint``: inspect and convert dsrun checkpoints from the shell.

* ``dsrun checkpoint info CKPT_DIR [--tag T] [--json]``: the tags in a save
  directory (``latest`` marked, interrupted saves listed) and, for the
  latest tag or ``--tag``, who saved it (world size, ZeRO stage, precision),
  the step, parameter and tensor counts, optimizer, and sizes. Reads JSON
  only: no torch is imported.
* ``dsrun checkpoint to-fp32 CKPT_DIR OUT [--tag T] [--safetensors]
  [--exclude_frozen_parameters]``: one plain fp32 state dict that
  ``torch.load`` + ``model.load_state_dict`` accept (or a safetensors
  file), written tensor by tensor so memory stays near the largest tensor;
  without the frozen parameters when asked (as ``zero_to_fp32``). torch is
  imported only here.
* ``dsrun checkpoint from-deepspeed DS_DIR OUT_DIR [--tag T]``: a
  checkpoint DeepSpeed's ``save_checkpoint`` wrote, as a dsrun checkpoint
  of the same tag (``engine.load_checkpoint(OUT_DIR)`` then loads it at any
  world size and stage); a kind of DeepSpeed checkpoint it does not import
  exits with status 2 and writes nothing.

Errors are one ``dsrun: error: ...`` line and a non-zero exit status.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Optional

import click

from dsrun.launcher.hosts_cli import reports_errors

CONTEXT = {"help_option_names": ["-h", "--help"]}


@click.group("checkpoint", context_settings=CONTEXT)
def checkpoint() -> None:
    """Inspect and convert dsrun checkpoints (engine.save_checkpoint)."""


@checkpoint.command("info", context_settings=CONTEXT)
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.option("--tag", default=None, help="The tag to describe (default: latest).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@reports_errors
def info_command(ckpt_dir: str, tag: Optional[str], as_json: bool) -> None:
    """Tags, world size, ZeRO stage, parameter count and sizes of a checkpoint."""
    from dsrun.runtime.checkpoint.info import checkpoint_info, format_info

    found = checkpoint_info(ckpt_dir, tag)
    if as_json:
        data = {k: v for k, v in asdict(found).items() if k != "selected"}
        data["selected"] = found.selected.summary() if found.selected else None
        click.echo(json.dumps(data, indent=1))
        return
    for line in format_info(found):
        click.echo(line)


@checkpoint.command("to-fp32", context_settings=CONTEXT)
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--tag", default=None, help="The tag to convert (default: latest).")
@click.option("--safetensors", "safetensors", is_flag=True,
              help="Write the safetensors format instead of torch.save's.")
@click.option("--exclude_frozen_parameters", "--exclude-frozen-parameters", "exclude_frozen",
              is_flag=True, help="Leave out the parameters that were frozen when saved.")
@reports_errors
def to_fp32_command(ckpt_dir: str, out: str, tag: Optional[str], safetensors: bool,
                    exclude_frozen: bool) -> None:
    """Write CKPT_DIR's weights to OUT as one fp32 state dict."""
    from dsrun.runtime.checkpoint.consolidate import to_fp32

    done = to_fp32(ckpt_dir, out, tag, safetensors=safetensors, exclude_frozen=exclude_frozen)
    click.echo(f"wrote {done.path}: {done.tensors} tensors, {done.bytes / 2**20:,.1f} MiB; "
               f"largest {done.largest} ({done.largest_bytes / 2**20:,.1f} MiB)")


@checkpoint.command("from-deepspeed", context_settings=CONTEXT)
@click.argument("ds_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--tag", default=None, help="The DeepSpeed tag to import (default: its latest).")
@reports_errors
def from_deepspeed_command(ds_dir: str, out_dir: str, tag: Optional[str]) -> None:
    """Import DS_DIR, a DeepSpeed checkpoint, into OUT_DIR as a dsrun checkpoint."""
    from dsrun.runtime.checkpoint.from_deepspeed import import_deepspeed_checkpoint

    path = import_deepspeed_checkpoint(ds_dir, out_dir, tag)
    click.echo(f"wrote {path} (load it with engine.load_checkpoint({out_dir!r}))")
