"""odls_base_sigkill_timeout set in Open MPI's parameter files is the user's
choice: dsrun's ``--mca`` (which wins over those files) is then left out
(openmpi.param_files, file_sets_sigkill_timeout)."""

from __future__ import annotations

from pathlib import Path

from dsrun.launcher.backends.openmpi import (
    SIGKILL_TIMEOUT,
    OpenMpiBackend,
    file_sets_sigkill_timeout,
    param_files,
)
from dsrun.launcher.spec import HostsSpec
from tests.unit.test_mpi_slurm_argv import _plan


def _argv(home: Path, conf: str | None) -> tuple[str, ...]:
    if conf is not None:
        (home / ".openmpi").mkdir(exist_ok=True)
        (home / ".openmpi" / "mca-params.conf").write_text(conf)
    backend = OpenMpiBackend(HostsSpec(launcher="openmpi"), environ={"HOME": str(home),
                                                                     "PATH": ""})
    return backend.argv(_plan(num_gpus=1))


def test_a_users_mca_params_conf_keeps_its_sigkill_timeout(tmp_path: Path):
    plain = tmp_path / "a"
    plain.mkdir()
    assert SIGKILL_TIMEOUT in _argv(plain, None)
    home = tmp_path / "b"
    home.mkdir()
    assert SIGKILL_TIMEOUT not in _argv(home, f"# mine\n{SIGKILL_TIMEOUT} = 5\n")
    other = tmp_path / "c"
    other.mkdir()
    assert SIGKILL_TIMEOUT in _argv(other, f"# {SIGKILL_TIMEOUT} = 5\nbtl = ^openib\n")


def test_param_files_and_their_parsing():
    assert param_files({"HOME": "/h"}, "/opt/ompi/bin/mpirun") == [
        "/h/.openmpi/mca-params.conf", "/opt/ompi/etc/openmpi-mca-params.conf"]
    assert "/etc/openmpi/openmpi-mca-params.conf" in param_files({"HOME": "/h"},
                                                                 "/usr/bin/mpirun")
    assert param_files({"OMPI_MCA_mca_base_param_files": "/a.conf,/b.conf"}, None) == [
        "/a.conf", "/b.conf"]
    assert file_sets_sigkill_timeout(["x = 1", f"  {SIGKILL_TIMEOUT}=3  # long saves"])
    assert not file_sets_sigkill_timeout([f"{SIGKILL_TIMEOUT}_other = 3", ""])
