"""Verdicts on a host's probe answer (pure): can the job run there?

:func:`evaluate` turns one host's ``facts`` (protocol.py) into a
:class:`HostReport`:

- errors: the job cannot run there (unreachable, no agent, working
  directory missing, script missing, a ``--log_dir`` file that cannot be
  opened, fewer GPUs than selected slots,
  master port taken, the same machine as another hostfile entry);
- mismatches: python/dsrun/torch versions differ from the launcher's (for
  dsrun also its sources: another copy of the same version), or
  master:port is not reachable from the host; these fail the preflight
  unless ``--no_preflight``.

Versions are compared only when the probe asked for them (multi-host jobs
and ``dsrun doctor``; a job on this host alone runs this interpreter).
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsrun import DSRUN_VERSION
from dsrun.errors import LaunchError
from dsrun.launcher.agent_os import dsrun_sources
from dsrun.launcher.netinfo import host_port, package_version


class PreflightFailed(LaunchError):
    """Some host cannot run the job; nothing was started."""


@dataclass(frozen=True)
class Expectations:
    """What every host should match: the launcher's own versions."""

    python: str
    dsrun: str
    torch: str | None
    dsrun_path: str | None = None  # the launcher's dsrun package directory
    dsrun_digest: str | None = None  # agent_os.dsrun_sources(); None: not compared

    @classmethod
    def here(cls, versions: bool = True) -> Expectations:
        """This host's; the digest of dsrun's sources (every file read) only
        where ``versions`` are compared (multi-host jobs, ``dsrun doctor``)."""
        path, digest = dsrun_sources() if versions else (None, None)
        return cls(platform.python_version(), DSRUN_VERSION, package_version("torch"),
                   path, digest)


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int


@dataclass(frozen=True)
class HostReport:
    host: str
    facts: dict[str, Any] | None
    errors: tuple[str, ...] = ()
    mismatches: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def ok(self, strict: bool = True) -> bool:
        return not self.errors and not (strict and self.mismatches)

    def line(self, width: int = 0, strict: bool = True) -> str:
        status = "ok  " if self.ok(strict) else "FAIL"
        text = "; ".join((*self.errors, *self.mismatches)) if not self.ok(strict) \
            else ", ".join(self.notes)
        return f"{self.host:<{width}}  {status}  {text}"


def _version_mismatches(facts: dict[str, Any], expect: Expectations) -> list[str]:
    if "python" not in facts:  # versions were not asked for
        return []
    out = []
    if facts.get("python") != expect.python:
        out.append(f"python {facts.get('python')} (launcher: {expect.python})")
    if facts.get("dsrun") != expect.dsrun:
        out.append(f"dsrun {facts.get('dsrun')} (launcher: {expect.dsrun})")
    elif expect.dsrun_digest and facts.get("dsrun_digest") not in (None, expect.dsrun_digest):
        # An older agent sends no digest: not compared.
        out.append(f"dsrun {facts.get('dsrun')} at {facts.get('dsrun_path')} is another copy "
                   f"than the launcher's ({expect.dsrun_path}): its sources differ (the "
                   f"node agent runs the dsrun its python imports, with the launcher's "
                   f"PYTHONPATH)")
    if expect.torch is not None and facts.get("torch") != expect.torch:
        have = facts.get("torch") or "not installed"
        out.append(f"torch {have} (launcher: {expect.torch})")
    return out


def _slot_check(host: str, devices: Sequence[object], slots: Sequence[int],
                cpu: bool = False) -> tuple[str | None, str]:
    if cpu:
        return None, f"--cpu: {len(slots)} CPU rank(s)"
    if not devices:
        return None, f"no GPU: {len(slots)} CPU rank(s)"
    need = max(slots) + 1
    if len(devices) < need:
        return (f"{host} has {len(devices)} GPU(s) but slots up to index {need - 1} are "
                f"selected"), ""
    return None, f"{len(slots)} GPU rank(s) of {len(devices)} GPU(s)"


def _notes(facts: dict[str, Any]) -> list[str]:
    if "python" not in facts:
        return [f"{facts.get('host')}"]
    return [f"{facts.get('host')}: python {facts.get('python')}",
            f"dsrun {facts.get('dsrun')}", f"torch {facts.get('torch') or '-'}"]


def evaluate(host: str, facts: dict[str, Any] | None, error: str | None,
             expect: Expectations, slots: Sequence[int], role: str,
             master: Rendezvous | None, master_problem: str | None = None,
             cpu: bool = False, script: str | None = None) -> HostReport:
    """One host's verdict from its probe answer (or the error instead of one);
    ``cpu``: the job asked for CPU ranks (--cpu), so GPUs are not checked;
    ``script``: the script the probe looked for (its answer: facts["script"])."""
    if facts is None:
        return HostReport(host, None, errors=(error or "no answer",))
    errors: list[str] = []
    notes = _notes(facts)
    problem, note = _slot_check(host, facts.get("devices") or [], slots, cpu)
    if problem:
        errors.append(problem)
    else:
        notes.append(note)
    if master_problem:
        errors.append(master_problem)
    mismatches = _version_mismatches(facts, expect)
    if role == "master" and master is not None:
        notes.append(f"master {host_port(master.addr, master.port)} (port free, held)")
    reach = facts.get("reach")
    if reach is not None and reach.get("error"):
        mismatches.append(f"cannot reach the master: {reach['error']}")
    elif reach is not None and master is not None:
        notes.append(f"reaches master {host_port(master.addr, master.port)}")
    if facts.get("ifname"):
        notes.append(f"via {facts['ifname']}")
    if facts.get("log_files"):
        errors.append(str(facts["log_files"]))
    if script is not None and facts.get("script"):
        errors.append(f"script {script!r} {facts['script']} on {host} "
                      f"(in {facts.get('cwd') or 'the working directory'})")
    return HostReport(host, facts, tuple(errors), tuple(mismatches), tuple(notes))


def same_machines(hosts: Sequence[str],
                  facts: Sequence[dict[str, Any] | None]) -> dict[int, str]:
    """Hostfile entries that are one machine (by name and by address, say):
    the later entry's index -> why. Hosts whose agent did not say who it
    is (an older dsrun) are not compared."""
    first: dict[str, int] = {}
    problems: dict[int, str] = {}
    for i, answer in enumerate(facts):
        who = (answer or {}).get("machine")
        if not who:
            continue
        if who in first:
            j = first[who]
            problems[i] = (f"{hosts[j]} and {hosts[i]} in the hostfile are the same machine "
                           f"(host name {(answer or {}).get('host')}); list it once")
        else:
            first[who] = i
    return problems
