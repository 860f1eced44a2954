"""The options that say where a job runs (shared by ``dsrun run`` and
``dsrun doctor``), and turning parsed options into the frozen specs that
the rest of dsrun takes (:class:`LaunchSpec`, :class:`HostsSpec`): click
never leaks below cli.py and this module.
"""

from __future__ import annotations

import os

import click

from dsrun.launcher.spec import (
    DEFAULT_SSH_TIMEOUT,
    LAUNCHER_ALIASES,
    LAUNCHERS,
    HostsSpec,
    LaunchSpec,
    SshOptions,
    cpu_by_deepspeed_variable,
    split_args,
)

__all__ = ["host_options", "hosts_spec_from_params", "spec_from_params"]


# Options that say where a job runs; shared by ``run`` and ``doctor``.
_HOST_OPTIONS = (
    click.option("-H", "--hostfile", "hostfile", default=None, metavar="PATH",
                 help="Hostfile of 'HOST slots=N' lines. Default: ./hostfile, else "
                      "/job/hostfile, when present; without one the job runs on this host."),
    click.option("-i", "--include", "include", default=None, metavar="NODES",
                 help="Use only these hosts/slots: HOST[:I,J][@HOST...] (DeepSpeed syntax)."),
    click.option("-e", "--exclude", "exclude", default=None, metavar="NODES",
                 help="Use all hosts/slots but these (same syntax as --include)."),
    click.option("--num_nodes", "--num-nodes", "num_nodes", type=int, default=None,
                 help="Number of hosts to use (the first N of the selection)."),
    click.option("--num_gpus", "--num-gpus", "--num_accelerators", "--num-accelerators",
                 "num_gpus", type=int, default=None,
                 help="Ranks per host (GPUs; on a host without GPUs, CPU ranks). "
                      "Default: all selected slots; without a hostfile all GPUs, or 2 CPU "
                      "ranks on a CPU-only host."),
    click.option("--cpu", "cpu", is_flag=True,
                 help="CPU ranks with gloo even on hosts that have GPUs (--num_gpus then "
                      "counts CPU ranks; the ranks see no GPU). DeepSpeed's DS_ACCELERATOR=cpu in "
                      "the environment does the same."),
    click.option("--master_addr", "--master-addr", "master_addr", default=None,
                 help="Rendezvous address (default: 127.0.0.1 on one host; else the first "
                      "host's address, found on that host)."),
    click.option("--master_port", "--master-port", "master_port", type=int, default=None,
                 help="Rendezvous port (default: a free port chosen on the first host)."),
    click.option("--launcher", "launcher", default=None, metavar="NAME",
                 help=f"How node agents start: {', '.join(LAUNCHERS)} "
                      f"({', '.join(f'{a} = {b}' for a, b in LAUNCHER_ALIASES.items())}). "
                      f"Default: ssh when a selected host is not this one, else local. Any "
                      f"case; DeepSpeed's pdsh is dsrun's ssh (paramiko, no pdsh needed)."),
    click.option("--launcher_args", "--launcher-args", "launcher_args", default=None,
                 metavar="ARGS",
                 help="Extra mpirun options for --launcher openmpi, one shell-quoted string "
                      "appended verbatim (e.g. \"--mca btl_tcp_if_include eth0\")."),
    click.option("--slurm_args", "--slurm-args", "slurm_args", default=None, metavar="ARGS",
                 help="srun options for --launcher slurm, one shell-quoted string (e.g. "
                      "\"--partition=gpu --time=30\"); required outside an allocation."),
    click.option("--ssh_port", "--ssh-port", "ssh_port", type=int, default=None,
                 help="SSH port (default: from ssh config, else 22)."),
    click.option("--ssh_user", "--ssh-user", "ssh_user", default=None,
                 help="SSH user (default: from ssh config, else the current user)."),
    click.option("--ssh_key", "--ssh-key", "ssh_key", default=None, metavar="PATH",
                 help="SSH private key to use (only this one)."),
    click.option("--ssh_config", "--ssh-config", "ssh_config", default=None, metavar="PATH",
                 envvar="DSRUN_SSH_CONFIG", show_envvar=True,
                 help="ssh_config file for HostName, Port, User, IdentityFile, "
                      "UserKnownHostsFile (default: ~/.ssh/config)."),
    click.option("--ssh_insecure", "--ssh-insecure", "ssh_insecure", is_flag=True,
                 help="Accept unknown or changed host keys (never saved). Default: refuse "
                      "hosts whose key is not in known_hosts."),
    click.option("--ssh_timeout", "--ssh-timeout", "ssh_timeout", type=float,
                 default=None,
                 help="Seconds to wait for a host's SSH connection and its agent's answer "
                      f"[default: {DEFAULT_SSH_TIMEOUT:g}; for the connection, ssh_config's "
                      "ConnectTimeout where set]."),
)


def host_options(func):
    for option in reversed(_HOST_OPTIONS):
        func = option(func)
    return func



def _ssh_options(params: dict[str, object]) -> SshOptions:
    timeout = params.pop("ssh_timeout")  # None: not given (ssh_config's ConnectTimeout may apply)
    return SshOptions(
        port=params.pop("ssh_port"), user=params.pop("ssh_user"),  # type: ignore[arg-type]
        key=params.pop("ssh_key"), config=params.pop("ssh_config"),  # type: ignore[arg-type]
        insecure=bool(params.pop("ssh_insecure")),
        timeout=DEFAULT_SSH_TIMEOUT if timeout is None else timeout,  # type: ignore[arg-type]
        timeout_given=timeout is not None,
    )


def _tool_args(params: dict[str, object]) -> None:
    for key, option in (("launcher_args", "--launcher_args"), ("slurm_args", "--slurm_args")):
        params[key] = split_args(params.get(key), option)  # type: ignore[arg-type]
    _empty_is_unset(params)


def _empty_is_unset(params: dict[str, object]) -> None:
    """``--include ""``, ``--exclude ""``, ``--master_addr ""``: not given.
    DeepSpeed's defaults are these empty strings, and wrapper scripts pass
    ``--include "$INCLUDE"``."""
    for key in ("include", "exclude", "master_addr"):
        if params.get(key) == "":
            params[key] = None


def spec_from_params(params: dict[str, object]) -> LaunchSpec:
    params = dict(params)
    extra_env = params.pop("env")
    ssh = _ssh_options(params)
    _tool_args(params)
    params["backend"] = params.pop("launcher")
    params["preflight"] = not params.pop("no_preflight")
    params["env_prefixes"] = tuple(params.pop("env_prefixes"))  # type: ignore[arg-type]
    params["cpu"] = bool(params["cpu"]) or cpu_by_deepspeed_variable(os.environ)
    return LaunchSpec(**params, extra_env=extra_env, ssh=ssh)  # type: ignore[arg-type]


def hosts_spec_from_params(params: dict[str, object]) -> HostsSpec:
    """The HostsSpec of the host options among ``params`` (others ignored);
    ``DS_ACCELERATOR=cpu`` is ``--cpu`` here too, as in :func:`spec_from_params`
    (``dsrun doctor`` checks the same hosts with and without SCRIPT)."""
    names = {p.name for p in host_options(lambda: None).__click_params__}  # type: ignore
    params = {k: v for k, v in params.items() if k in names}
    ssh = _ssh_options(params)
    _tool_args(params)
    params["cpu"] = bool(params.get("cpu")) or cpu_by_deepspeed_variable(os.environ)
    return HostsSpec(**params, ssh=ssh)  # type: ignore[arg-type]
