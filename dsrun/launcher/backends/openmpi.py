"""Open MPI backend: one ``mpirun`` starts every rank's agent (``--launcher openmpi``).

The plan becomes one mpirun argv (:func:`mpirun_argv`, pure and
golden-tested): ``-np WORLD``, ``-H`` with one host per rank in rank order
(this host as ``localhost``) and ``--map-by seq`` (Open MPI's sequential
mapping), so that every rank runs on its plan host and local rank (with
``-H host:ranks`` and ``--map-by slot`` Open MPI maps its own host first
when that host is in the job; ``--mca rmaps seq`` instead would also map
``MPI_Comm_spawn``'s processes by -H, which lists none for them, and the
spawn fails), ``--bind-to none`` (unless
--launcher_args binds: ranks see the host's CPUs as under the other
launchers, and OMP_NUM_THREADS shares them), ``-x NAME`` for every variable the
agents need (values in mpirun's environment, never on its command line),
``--allow-run-as-root`` only as root, dsrun's SSH options as
``--mca plm_rsh_args`` (mpirun reaches other hosts over ssh),
``--mca odls_base_sigkill_timeout`` (:func:`sigkill_timeout`), then
``--launcher_args`` verbatim, then the agent. Each MPI process is an agent
in connect mode (connect.py): it connects back, is probed and planned like
an SSH agent, and starts its rank as a child, which inherits the MPI
variables, so ``MPI_Init`` in the rank joins mpirun's job (mpi4py and
``MPI.Comm.Spawn`` work there).

mpirun answers a SIGTERM or SIGINT of its own (``kill`` of its pid; Slurm's
signal to every process of a batch step) by stopping its processes, the
agents: SIGCONT at once, SIGTERM after ``odls_base_sigkill_timeout``
seconds, SIGKILL as long again after that (Open MPI 4.1's odls, measured
here; its default is 1 s, so a rank saving on SIGTERM was cut off after
about a second). dsrun sets it to ``--kill_grace`` + 1, rounded up (Open MPI
takes whole seconds): an agent that gets mpirun's SIGTERM then gives its
ranks the whole grace before mpirun's SIGKILL, and when every process got
the signal directly, mpirun's own copy comes after the agent's grace has run
out, not as a "second signal" that hurries the stop. The price: a signal to
mpirun alone reaches the ranks that much later. ``--launcher_args "--mca
odls_base_sigkill_timeout N"``, ``OMPI_MCA_odls_base_sigkill_timeout`` in
the environment, or the key in one of Open MPI's parameter files
(:func:`param_files`: ``~/.openmpi/mca-params.conf``, the installation's
``openmpi-mca-params.conf``) is the user's choice and kept; a value from a
``--tune``/``--am`` file is not seen (dsrun's ``--mca`` wins over it). mpirun's sequence blocks
its own exit too: a mpirun that dsrun must SIGKILL (a Ctrl-C while the
agents start, a stop it does not finish in time) leaves its session
directory on this host, which :func:`remove_session_dir` removes (and
its ``ompi.<host>.<uid>`` parent when that is empty). A SIGTERM does not
wake a mpirun sleeping out its sequence, it only starts one: dsrun never
sends it one, it SIGKILLs it, then the agents it leaves on this host
(tool_stop.py). Once every agent has said ``done``, mpirun gets
:data:`ENDED_WAIT` to exit: it exits at once unless it sleeps out that
sequence (after a signal to every process of the job, a rank's
``MPI_Abort``, an agent's failure), which would hold dsrun's report back
twice the grace. When an agent was lost, mpirun gets ``--kill_grace`` + 10 s,
and is SIGKILLed as soon as no agent of the job is left on this host.

Before anything starts (:meth:`OpenMpiBackend.check`): mpirun must be on
PATH and be Open MPI's, and mpi4py must import and use the same MPI
library (vendor and version), else one error naming the fix.

mpirun runs by its name (``argv[0]`` is ``mpirun``; the file executed is
the one the check found on PATH), as it runs when typed and under
DeepSpeed: Open MPI treats an absolute ``argv[0]`` as ``--prefix`` of its
directory and puts that prefix's ``bin``/``lib`` in front of every
process's ``PATH``/``LD_LIBRARY_PATH`` (``/usr/bin`` ahead of an activated
venv; ``/bin/mpirun`` fails outright with a prefix of only slashes). A
``--prefix`` the user wants (Open MPI's way to find ``orted`` on hosts whose
login PATH lacks it) goes in ``--launcher_args``, where ``--dry-run`` shows it;
when mpirun fails because a host did not find ``orted`` (``bash: orted:
command not found``), the error says so and names the directory
(:func:`prefix_advice`).
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dsrun.errors import DsrunUsageError
from dsrun.launcher import netinfo
from dsrun.launcher.backends.base import (
    AgentRequest,
    Backend,
    ConnectSink,
    JobHandle,
    OutputSink,
    Request,
    agent_payload,
    ignore_connect,
)
from dsrun.launcher.backends.connect import open_connected, tool_environment
from dsrun.launcher.plan import LaunchPlan
from dsrun.launcher.protocol import AGENT_BOOTSTRAP_VARS
from dsrun.launcher.spec import HostsSpec, SshOptions

if TYPE_CHECKING:
    from dsrun.launcher.cluster import Cluster

#: mpirun options (Open MPI 4.1's ``mpirun --help all``) that decide how many
#: ranks run, on which hosts, or in which order: dsrun sets them from the plan.
CONTROLLED = ("-np", "-n", "--n", "-c", "--np", "-N", "-H", "-host", "--host",
              "-hostfile", "--hostfile", "-machinefile", "--machinefile",
              "-default-hostfile", "--default-hostfile", "-npernode", "--npernode",
              "-npersocket", "--npersocket", "-pernode", "--pernode", "-nolocal", "--nolocal",
              "--ppr", "-ppr", "-rf", "--rankfile", "--app", "-bynode", "--bynode")
#: Installations whose bin directory every login PATH has (and whose
#: --prefix would put /usr/bin ahead of a venv: the module docstring).
SYSTEM_PREFIXES = ("/", "/usr", "/usr/local")
#: Open MPI's seconds between the steps of its kill sequence (module docstring).
SIGKILL_TIMEOUT = "odls_base_sigkill_timeout"
#: Seconds mpirun gets to exit once every agent has said ``done``, before
#: SIGKILL (no SIGTERM step: module docstring).
ENDED_WAIT = (0.75, 0.0)
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def rsh_args(ssh: SshOptions) -> str | None:
    """dsrun's SSH options as ssh flags for mpirun's remote launches."""
    words: list[str] = []
    if ssh.config:
        words += ["-F", ssh.config]
    if ssh.port is not None:
        words += ["-p", str(ssh.port)]
    if ssh.user:
        words += ["-l", ssh.user]
    if ssh.key:
        words += ["-i", ssh.key]
    if ssh.insecure:
        words += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    return " ".join(words) or None


def env_names(plan: LaunchPlan) -> tuple[str, ...]:
    """Variables mpirun/srun pass to the agents by name: the callback ones,
    then the user's and forwarded ones (sorted), less the env-file values
    the agents expand (``UserEnv.passed_as_is``)."""
    return (*sorted(AGENT_BOOTSTRAP_VARS), *plan.user_env.passed_as_is())


def sigkill_timeout(kill_grace: float) -> int:
    """``odls_base_sigkill_timeout`` for a job's ``--kill_grace`` (pure): whole
    seconds, one more than the grace (the module docstring says why)."""
    return math.ceil(kill_grace) + 1


def sets_sigkill_timeout(launcher_args: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether the user chose ``odls_base_sigkill_timeout`` (``--mca``/``-mca``
    /``--gmca`` in --launcher_args, or Open MPI's environment variable)."""
    return SIGKILL_TIMEOUT in launcher_args or f"OMPI_MCA_{SIGKILL_TIMEOUT}" in environ


def param_files(environ: Mapping[str, str], mpirun: str | None) -> list[str]:
    """Open MPI's MCA parameter files for ``mpirun`` (pure): those
    ``OMPI_MCA_mca_base_param_files`` names, else the user's
    ``~/.openmpi/mca-params.conf`` and the installation's
    ``<prefix>/etc/openmpi-mca-params.conf`` (Debian's /etc/openmpi/ for a
    mpirun in /usr/bin)."""
    named = environ.get("OMPI_MCA_mca_base_param_files")
    if named:
        return [f for f in re.split(r"[,:]", named) if f]
    home = environ.get("HOME") or os.path.expanduser("~")
    files = [os.path.join(home, ".openmpi", "mca-params.conf")]
    if mpirun:
        prefix = os.path.dirname(os.path.dirname(mpirun))
        files.append(os.path.join(prefix, "etc", "openmpi-mca-params.conf"))
        if prefix in SYSTEM_PREFIXES:
            files.append("/etc/openmpi/openmpi-mca-params.conf")
    return files


def file_sets_sigkill_timeout(texts: Sequence[str]) -> bool:
    """Whether one of these parameter files' texts sets
    ``odls_base_sigkill_timeout`` (``name = value`` lines, ``#`` comments; pure)."""
    for text in texts:
        for line in text.splitlines():
            key = line.split("#", 1)[0].split("=", 1)
            if len(key) == 2 and key[0].strip() == SIGKILL_TIMEOUT:
                return True
    return False


def _read_texts(paths: Sequence[str]) -> list[str]:
    texts = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read(1_000_000))
        except OSError:
            continue
    return texts


def session_dirs(pid: int, environ: Mapping[str, str]) -> list[str]:
    """The session directories on this host of the mpirun with ``pid``:
    ``<tmp>/ompi.<host>.<uid>/pid.<pid>`` (Open MPI 4.1), ``<tmp>`` being
    ``orte_tmpdir_base`` if set in the environment, else TMPDIR, TEMP, TMP
    or /tmp (Open MPI's own order)."""
    bases = (environ.get("OMPI_MCA_orte_tmpdir_base"), environ.get("TMPDIR"),
             environ.get("TEMP"), environ.get("TMP"), "/tmp")
    found: list[str] = []
    for base in dict.fromkeys(b for b in bases if b):
        found += glob.glob(os.path.join(glob.escape(base), f"ompi.*.{os.getuid()}",
                                        f"pid.{pid}"))
    return found


def remove_session_dir(pid: int, environ: Mapping[str, str]) -> None:
    """Remove what a SIGKILLed mpirun (``pid``, just reaped) left on this
    host, and the ``ompi.<host>.<uid>`` directory above it if nothing else
    is left there (another mpirun's); mpirun removes both when it exits."""
    for path in session_dirs(pid, environ):
        shutil.rmtree(path, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass  # not empty: in use by another mpirun of this user


def mpirun_argv(plan: LaunchPlan, agent_argv: Sequence[str], *, mpirun: str = "mpirun",
                launcher_args: Sequence[str] = (), ssh: SshOptions | None = None,
                as_root: bool = False, environ: Mapping[str, str] | None = None,
                user_sigkill_timeout: bool = False) -> tuple[str, ...]:
    """The one mpirun command of a plan (pure); ``environ``: mpirun's
    environment, for the user's Open MPI settings; ``user_sigkill_timeout``:
    a parameter file sets it (:func:`file_sets_sigkill_timeout`)."""
    # Open MPI maps its own node first whatever -H's order (--map-by slot), so
    # the sequential mapping gets one -H entry per rank, in rank order (a
    # --map-by in --launcher_args comes later and wins; placement_problem
    # then checks where the ranks went).
    hosts = ",".join("localhost" if n.local else n.host for n in plan.nodes for _ in n.ranks)
    argv = [mpirun, "-np", str(plan.world_size), "-H", hosts, "--map-by", "seq"]
    if not any(a.lstrip("-").split("=")[0] == "bind-to" for a in launcher_args):
        # mpirun binds each process to one core by default (np <= 2); the
        # agent's rank would inherit that. Ranks see the host's CPUs, as
        # under the other launchers, unless --launcher_args says otherwise.
        argv += ["--bind-to", "none"]
    if as_root:
        argv.append("--allow-run-as-root")
    argv += ["--wdir", plan.cwd]
    for name in env_names(plan):
        argv += ["-x", name]
    rsh = rsh_args(ssh or SshOptions())
    if rsh:
        argv += ["--mca", "plm_rsh_args", rsh]
    if not user_sigkill_timeout and not sets_sigkill_timeout(launcher_args, environ or {}):
        # mpirun's own SIGTERM must leave the agents their --kill_grace.
        argv += ["--mca", SIGKILL_TIMEOUT, str(sigkill_timeout(plan.kill_grace))]
    argv += launcher_args
    argv += [*agent_argv, "--connect"]
    return tuple(argv)


def controlled_problem(args: Sequence[str], controlled: Sequence[str], option: str,
                       instead: str, attached_short: bool = False) -> str | None:
    """Why ``args`` may not contain one of the ``controlled`` options (pure).

    ``attached_short``: one-letter options may carry their value (``-N2``,
    getopt style, as srun parses them).
    """
    for arg in args:
        name = arg.split("=", 1)[0]
        short = attached_short and any(
            len(c) == 2 and c[1] != "-" and name.startswith(c) for c in controlled)
        if name in controlled or short:
            return f"{option}: {arg!r} decides where ranks run, which dsrun sets; {instead}"
    return None


def version_problem(mpirun: str, mpirun_text: str, library: str | None,
                    import_error: str | None) -> str | None:
    """Why mpirun and mpi4py cannot run a dsrun job together, or None (pure).

    ``mpirun_text``: ``mpirun --version`` output; ``library``: mpi4py's
    ``MPI.Get_library_version()``.
    """
    first = mpirun_text.strip().splitlines()[0] if mpirun_text.strip() else "nothing"
    if "Open MPI" not in mpirun_text:
        return (f"--launcher openmpi: {mpirun} is not Open MPI's mpirun (its --version says "
                f"{first!r}); put Open MPI's bin directory first on PATH")
    if import_error is not None:
        return (f"--launcher openmpi: mpi4py cannot be used by {sys.executable}: "
                f"{import_error}; install it with `{sys.executable} -m pip install mpi4py`")
    assert library is not None
    have, want = _VERSION.search(library), _VERSION.search(mpirun_text)
    if "Open MPI" not in library or have is None or want is None \
            or have.group(1, 2) != want.group(1, 2):
        lib = library.split(",")[0].strip()
        return (f"--launcher openmpi: mpi4py uses {lib!r} but {mpirun} is {first!r}; "
                f"rebuild mpi4py against it (`{sys.executable} -m pip install --no-binary "
                f"mpi4py --force-reinstall mpi4py`) or put the matching mpirun first on PATH")
    return None


def prefix_advice(summary: str, mpirun: str | None) -> str:
    """The fix when mpirun's failure ``summary`` says a remote host did not
    find Open MPI's daemon (``orted``; ``prted`` in Open MPI 5): that host's
    non-interactive login PATH lacks Open MPI, which ``--prefix`` (the
    directory above the ``mpirun`` found here, ``mpirun``) supplies; "" for
    any other failure - also for another command a login script did not
    find, such as ``bash: module: command not found`` (pure)."""
    lower = summary.lower()
    if "not found" not in lower or not ("orted" in lower or "prted" in lower):
        return ""
    prefix = os.path.dirname(os.path.dirname(mpirun)) if mpirun else "DIR"
    lacks = "a host's non-interactive login PATH lacks Open MPI's daemon (orted)"
    if prefix in SYSTEM_PREFIXES:  # already on every login PATH: not installed there
        return (f"{lacks}: install Open MPI (the version of {mpirun}) on every host, or "
                f"pass --launcher_args \"--prefix DIR\" with the directory it is installed "
                f"in there")
    return (f"{lacks}: pass --launcher_args \"--prefix {prefix}\" (the Open MPI "
            f"installation of {mpirun or 'mpirun'}; the same path on every host), or put "
            f"its bin directory on that PATH")


def mpi4py_library() -> tuple[str | None, str | None]:
    """(MPI library version mpi4py loads, None) or (None, why it cannot)."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # only asking the library: no MPI_Init here
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        return str(MPI.Get_library_version()).rstrip("\x00").strip(), None
    except Exception as exc:  # noqa: BLE001 - ImportError, or a missing libmpi
        return None, f"{type(exc).__name__}: {exc}"


class OpenMpiBackend(Backend):
    name = "openmpi"
    agent_per_rank = True
    login_env = True

    def __init__(self, hosts: HostsSpec | None = None, python: str = sys.executable,
                 environ: Mapping[str, str] | None = None, mpirun: str | None = None,
                 as_root: bool | None = None) -> None:
        super().__init__(hosts, python)
        self.environ = dict(os.environ if environ is None else environ)
        self.mpirun = mpirun or "mpirun"
        # The file check() found for self.mpirun, run under that name (module docstring).
        self.executable: str | None = None
        self.as_root = os.geteuid() == 0 if as_root is None else as_root

    def check(self, cluster: Cluster) -> None:
        problem = controlled_problem(self.hosts.launcher_args, CONTROLLED, "--launcher_args",
                                     "choose hosts and ranks with -H/--include/--exclude/"
                                     "--num_nodes/--num_gpus")
        if problem:
            raise DsrunUsageError(problem)
        path = shutil.which(self.mpirun, path=self.environ.get("PATH"))
        if path is None:
            raise DsrunUsageError(
                f"--launcher openmpi: {self.mpirun} is not on PATH; install Open MPI (Debian: "
                f"apt-get install openmpi-bin) or put its bin directory on PATH")
        self.executable = path
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=30, env=self.environ)
            text = out.stdout + out.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"cannot run it: {exc}"
        problem = version_problem(path, text, *mpi4py_library())
        if problem:
            raise DsrunUsageError(problem)

    def argv(self, plan: LaunchPlan) -> tuple[str, ...]:
        files = param_files(self.environ, self.executable or shutil.which(
            self.mpirun, path=self.environ.get("PATH")))
        return mpirun_argv(plan, self.agent_argv(), mpirun=self.mpirun,
                           launcher_args=self.hosts.launcher_args, ssh=self.hosts.ssh,
                           as_root=self.as_root, environ=self.environ,
                           user_sigkill_timeout=file_sets_sigkill_timeout(_read_texts(files)))

    def prepare(self, plan: LaunchPlan) -> Request:
        agents = []
        for node in plan.nodes:
            where = "here" if node.local else f"on {node.host}"
            login = "dsrun's environment" if node.local else "its login environment"
            base = f"the environment mpirun gives its processes {where} ({login} and -x)"
            for slot in node.ranks:
                agents.append(AgentRequest(
                    node.host, agent_payload(plan, node, [slot]),
                    f"started by mpirun, one agent per rank: {self.python} -m "
                    f"dsrun.launcher.agent --connect", base,
                    self.environ if node.local else None))
        return Request(self.name, plan, tuple(agents), self.argv(plan), env_names(plan))

    def open(self, plan: LaunchPlan, sink: OutputSink,
             on_connect: ConnectSink = ignore_connect) -> JobHandle:
        prefer = [netinfo.route_source(n.host) for n in plan.nodes if not n.local]
        timeout = max(60.0, 6 * self.hosts.ssh.timeout)
        return open_connected(plan, "mpirun", self.argv(plan),
                              tool_environment(plan, self.environ), sink,
                              [p for p in prefer if p], timeout,
                              agent_timeout=max(30.0, 3 * self.hosts.ssh.timeout),
                              on_connect=on_connect, executable=self.executable,
                              advice=lambda summary: prefix_advice(summary, self.executable),
                              after_kill=lambda pid: remove_session_dir(pid, self.environ),
                              ended_wait=ENDED_WAIT, kill_agents=True,
                              options="--launcher_args" if self.hosts.launcher_args else None)
