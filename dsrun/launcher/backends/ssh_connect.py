"""Opening one SSH connection: where to (ssh_config and the --ssh_* flags,
resolved into a frozen :class:`SshTarget`, ProxyJump hosts included), host
key checks against the known_hosts files (ssh_hostkeys.py, ssh_known.py;
never saved), and one error message per way it fails, naming the host and
the fix.

ssh_config keys read: HostName, Port, User, IdentityFile, IdentitiesOnly,
UserKnownHostsFile, GlobalKnownHostsFile, StrictHostKeyChecking,
HostKeyAlias, ConnectTimeout, ProxyJump, ProxyCommand (ssh_proxy.py), and
Include (ssh_configfile.py), from ~/.ssh/config and then the system-wide
/etc/ssh/ssh_config (the first value obtained wins, as in ssh; with
--ssh_config, as with ``ssh -F``, that file alone; what dsrun cannot read
in the system file is skipped with a warning: ssh_configfile.py). Keys that
change how ssh connects but are not used here are named in connection
errors (counted, when only the system file sets them). StrictHostKeyChecking ``no``
still checks: a changed key is warned about (one line), then accepted, as
ssh does; ``accept-new`` accepts unknown keys only.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import pwd
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import paramiko

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends.ssh_auth import KeyPlan, key_plan, no_key_message
from dsrun.launcher.backends.ssh_configfile import (
    USER_CONFIG_DIR,
    parse_time,
    read_configs,
    unused_settings,
)
from dsrun.launcher.backends.ssh_hostkeys import (  # noqa: F401 - key_names: importable here
    SSH_PORT,
    USER_KNOWN_HOSTS,
    HostKeyPolicy,
    RejectedHostKey,
    UnknownHostKey,
    bad_key_message,
    key_names,
    load_known,
    rejected_message,
    transport_factory,
    unknown_key_message,
)
from dsrun.launcher.backends.ssh_proxy import (
    RoutedClient,
    SshConnectError,
    check_user,
    expand_tokens,
    open_route,
    parse_jumps,
    proxy_failure,
)
from dsrun.launcher.spec import SshOptions

#: Most ProxyJump hops before a target (a longer chain is taken for a loop).
MAX_JUMPS = 8
#: Key of a lookup result that carries ssh_config notes (no ssh_config key has a space).
NOTES_KEY = "dsrun notes"
DEFAULT_CONFIG = "~/.ssh/config"
#: read after DEFAULT_CONFIG, as ssh reads it; looked up at call time (tests set it)
SYSTEM_CONFIG = "/etc/ssh/ssh_config"
SYSTEM_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")

Lookup = Callable[[str], Mapping[str, Any]]


# --------------------------------------------------------------------------
# targets (pure)


@dataclass(frozen=True)
class SshTarget:
    """Everything needed to reach one host, resolved from options and config."""

    host: str  # as written in the hostfile
    hostname: str  # where to connect (ssh_config HostName)
    port: int
    user: str
    keys: tuple[str, ...]
    identities_only: bool
    known_hosts: tuple[str, ...]
    host_keys: str  # "strict" | "accept-new" | "no" (warn, connect) | "off"
    timeout: float
    jump: SshTarget | None = None  # ProxyJump: the host just before this one
    proxy_command: str | None = None  # with its %-tokens (ssh_proxy.py)
    host_key_alias: str | None = None
    notes: tuple[str, ...] = ()  # ssh_config dsrun does not honour, for errors
    timeout_from: str = "--ssh_timeout"  # where ``timeout`` came from, for errors
    #: for authentication and channels: --ssh_timeout's value where ``timeout``
    #: is ConnectTimeout, which (as in ssh) bounds only the connection and
    #: the handshake; None: ``timeout``
    session_timeout: float | None = None

    @property
    def proxied(self) -> bool:
        """Reached through another host: its HostName means what it means there."""
        return self.jump is not None or self.proxy_command is not None

    @property
    def address(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{host}:{self.port}"

    def describe(self) -> str:
        via = f" (via {self.jump.host})" if self.jump else \
            " (via ProxyCommand)" if self.proxy_command else ""
        return f"ssh {self.user}@{self.address}{via}"


def _host_key_mode(options: SshOptions, config: Mapping[str, Any]) -> str:
    if options.insecure:
        return "off"
    strict = str(config.get("stricthostkeychecking", "yes")).lower()
    return {"no": "no", "off": "no", "accept-new": "accept-new"}.get(strict, "strict")


def default_user() -> str:
    """The login name ssh uses: the passwd entry of this uid ($USER and
    $LOGNAME may still name someone else after ``su``)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return getpass.getuser()


def _timeout(options: SshOptions, config: Mapping[str, Any], host: str) -> float | None:
    """ssh_config's ConnectTimeout, unless --ssh_timeout is given (None:
    use the option). ``0`` (ssh: the system's TCP timeout) and ``none``
    leave the option's value."""
    text = config.get("connecttimeout")
    if options.timeout_given or text is None or str(text).lower() == "none":
        return None
    seconds = parse_time(str(text))
    if seconds is None:
        raise DsrunUsageError(f"ssh config: bad ConnectTimeout {text!r} for host {host} "
                              f"(seconds, or a time such as 30s, 1m, 1m30s)")
    return float(seconds) or None


def _proxy_settings(config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """ProxyCommand and ProxyJump as OpenSSH takes them: whichever was
    obtained first (``none`` included) prevents the other. The lookup's
    keys are in the order they were first obtained."""
    first = next((k for k in config if k in ("proxycommand", "proxyjump")), None)
    if first is None:
        return None, None
    value = _setting(config, first)
    return (value, None) if first == "proxycommand" else (None, value)


def _setting(config: Mapping[str, Any], key: str) -> str | None:
    value = config.get(key)
    return None if value is None or str(value).lower() == "none" else str(value)


def resolve_target(host: str, options: SshOptions, config: Mapping[str, Any],
                   default_user: str, lookup: Lookup | None = None,
                   _depth: int = 0) -> SshTarget:
    """Where and how to connect to ``host``: flags win over ssh_config.
    ``lookup`` gives the ssh_config of ProxyJump hosts."""
    if options.user and _depth == 0:  # a jump host's user was checked in its ProxyJump
        check_user(options.user, "--ssh_user")
    port_text = options.port if options.port is not None else config.get("port", SSH_PORT)
    try:
        port = int(port_text)
    except ValueError:
        raise DsrunUsageError(f"ssh config: bad Port {port_text!r} for host {host}") from None
    if options.key:
        keys: tuple[str, ...] = (os.path.expanduser(options.key),)
        only = True
    else:
        keys = tuple(os.path.expanduser(k) for k in config.get("identityfile", ()))
        only = str(config.get("identitiesonly", "no")).lower() == "yes"
    user_files = str(config.get("userknownhostsfile", "")).split() or list(USER_KNOWN_HOSTS)
    global_files = str(config.get("globalknownhostsfile", "")).split() \
        or list(SYSTEM_KNOWN_HOSTS)
    known = tuple(os.path.expanduser(f) for f in (*user_files, *global_files)
                  if f not in ("/dev/null", "none"))
    command, jumps = _proxy_settings(config)
    connect_timeout = _timeout(options, config, host)
    target = SshTarget(
        host=host, hostname=str(config.get("hostname", host)), port=port,
        user=options.user or str(config.get("user") or default_user), keys=keys,
        identities_only=only, known_hosts=known, host_keys=_host_key_mode(options, config),
        timeout=options.timeout if connect_timeout is None else connect_timeout,
        timeout_from="--ssh_timeout" if connect_timeout is None else
        "ConnectTimeout in ssh config", proxy_command=command,
        session_timeout=None if connect_timeout is None else options.timeout,
        host_key_alias=_setting(config, "hostkeyalias"),
        notes=(*config.get(NOTES_KEY, ()), *unused_settings(config)),
    )
    if jumps:
        jump = _resolve_jump(target, expand_tokens(jumps, target, "ProxyJump"), options,
                             lookup or (lambda name: {}), default_user, _depth)
        target = dataclasses.replace(target, jump=jump)
    return target


def _resolve_jump(target: SshTarget, value: str, options: SshOptions, lookup: Lookup,
                  user: str, depth: int) -> SshTarget:
    """The last hop of ``value``, reached through the hops before it (as
    ``ssh -J`` does); the flags for the job's hosts do not apply to it."""
    hops = parse_jumps(value, target.host)
    last = hops[-1]
    if depth >= MAX_JUMPS or last.host == target.host:
        raise DsrunUsageError(f"ssh config: ProxyJump loop for host {target.host} (via "
                              f"{last.host}); exclude the jump host from the Host pattern "
                              f"that sets ProxyJump")
    config = dict(lookup(last.host))
    if len(hops) > 1:
        config.pop("proxycommand", None)
        # already expanded once, on the target: %% keeps a % (a scope id) a %
        config["proxyjump"] = ",".join(h.text().replace("%", "%%") for h in hops[:-1])
    hop_options = SshOptions(port=last.port, user=last.user, config=options.config,
                             insecure=options.insecure, timeout=options.timeout,
                             timeout_given=options.timeout_given)
    return resolve_target(last.host, hop_options, config, user, lookup, depth + 1)


def config_lookup(path: str | None, system_config: str | None = None) -> Lookup:
    """ssh_config lookups from ``path`` (--ssh_config: that file alone, as
    ``ssh -F``), else from ~/.ssh/config and then ``system_config``
    (default :data:`SYSTEM_CONFIG`), those present, as ssh reads them,
    Includes expanded; what dsrun cannot evaluate rides along as NOTES_KEY."""
    site: tuple[str, str] | None = None
    if path is None:
        system = SYSTEM_CONFIG if system_config is None else system_config
        # as ssh: a default file that is absent or cannot be read is passed over
        user = os.path.expanduser(DEFAULT_CONFIG)
        files = [(user, USER_CONFIG_DIR)] if _readable(user) else []
        site = (system, os.path.dirname(system)) if _readable(system) else None
        if not files and site is None:
            return paramiko.SSHConfig().lookup
    elif not os.path.isfile(path):
        raise DsrunUsageError(f"--ssh_config {path} does not exist")
    else:
        files = [(path, USER_CONFIG_DIR)]
    parsed = read_configs(files, site)

    def lookup(host: str) -> Mapping[str, Any]:
        found = parsed.lookup(host)
        notes = parsed.notes_for(host, found)
        if notes:
            found[NOTES_KEY] = notes
        return found

    return lookup


def _readable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.R_OK)


# --------------------------------------------------------------------------
# connecting (I/O)


def _open_socket(target: SshTarget) -> socket.socket:
    t = target.timeout
    try:
        return socket.create_connection((target.hostname, target.port), timeout=t)
    except socket.timeout:
        raise SshConnectError(f"{target.host}: no answer from {target.address} within "
                              f"{t:g}s ({target.timeout_from})") from None
    except ConnectionRefusedError:
        raise SshConnectError(f"{target.host}: connection refused by {target.address} "
                              f"(is sshd running there?)") from None
    except socket.gaierror as exc:
        raise SshConnectError(f"{target.host}: cannot resolve host name "
                              f"{target.hostname!r}: {exc.strerror}") from None
    except OSError as exc:
        raise SshConnectError(f"{target.host}: cannot connect to {target.address}: "
                              f"{exc.strerror or exc}") from None


def connect(target: SshTarget) -> paramiko.SSHClient:
    """An authenticated connection to ``target`` (through its ProxyJump or
    ProxyCommand; closing it closes those too); SshConnectError says why not."""
    for key in target.keys:
        if target.identities_only and not os.path.isfile(key):
            raise SshConnectError(f"{target.host}: ssh key {key} does not exist")
    plan: KeyPlan | None = None
    try:
        plan = key_plan(target)
        if not plan.sources:
            raise SshConnectError(_noted(target, no_key_message(target, plan)))
        known = load_known(target)
        sock, carriers = open_route(target, connect, _open_socket)
        client = RoutedClient(carriers)
        try:
            client.set_missing_host_key_policy(HostKeyPolicy(target, known))
            t, session = target.timeout, target.session_timeout or target.timeout
            client.connect(
                target.hostname, port=target.port, username=target.user, sock=sock,
                timeout=t, banner_timeout=t, auth_timeout=session, channel_timeout=session,
                auth_strategy=plan.strategy(),
                transport_factory=transport_factory(known.key_types(*key_names(target))),
            )
            return client
        except BaseException as exc:
            failed = proxy_failure(target, carriers) if isinstance(exc, Exception) else None
            client.close()
            sock.close()
            if isinstance(exc, Exception):
                raise SshConnectError(_noted(target, failed or _connect_error(
                    target, exc, plan.tried))) from None
            raise
    finally:
        if plan is not None:
            plan.close()


def _noted(target: SshTarget, message: str) -> str:
    if not target.notes:
        return message
    return (f"{message} [ssh config that dsrun does not use for {target.host}: "
            f"{'; '.join(target.notes)}]")


def _connect_error(target: SshTarget, exc: Exception, tried: list[str] | None = None) -> str:
    if isinstance(exc, SshConnectError):
        return str(exc)
    if isinstance(exc, UnknownHostKey):
        return unknown_key_message(target, exc.key, exc.authority, exc.other_name)
    if isinstance(exc, RejectedHostKey):
        return rejected_message(target, exc)
    if isinstance(exc, paramiko.BadHostKeyException):
        return bad_key_message(target, exc.hostname)
    if isinstance(exc, paramiko.AuthenticationException):
        keys = "; ".join(tried or ()) or ", ".join(target.keys) or "default keys and ssh-agent"
        return (f"{target.host}: authentication as {target.user}@{target.address} failed "
                f"(tried {keys}); use --ssh_user/--ssh_key or User/IdentityFile in ssh config")
    # paramiko gives up on a silent server as "Error reading SSH protocol banner"
    # or, when the key exchange times out, as "No existing session" at auth.
    text = str(exc)
    if isinstance(exc, (socket.timeout, TimeoutError)) or "banner" in text \
            or "No existing session" in text:
        return (f"{target.host}: no SSH answer from {target.address} within "
                f"{target.timeout:g}s ({target.timeout_from})")
    return f"{target.host}: SSH to {target.address} failed: {exc or type(exc).__name__}"
