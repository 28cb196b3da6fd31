"""Launchers: programs that start the replicas and tell each, in its environment, who it is.
Only the first of :data:`LAUNCHERS` recognized is read (an inner launcher also sees the outer
one's variables): see the README, *Launchers*."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

from .._hostlist import first_host
from ._values import Origin, converted, to_int, variable

LOOPBACK = "127.0.0.1"  # MPI ranks all on one host find rank 0 here
SLURM_PORT_BASE = 20000  # Slurm's port is BASE + SLURM_JOB_ID % SPAN: 20000-29999, below Linux's
SLURM_PORT_SPAN = 10000  # ephemeral ports (32768+) and IANA's (49152+); jobs collide 10000 ids apart


@dataclass(frozen=True)
class Reader:
    """How one launcher gives one setting."""

    variables: tuple[str, ...]  # what it reads, in the order the README names them
    read: Callable[[Mapping[str, str]], Optional[Origin]]  # env -> the value's origin; None: not said


def _plain(name: str) -> Reader:
    return Reader((name,), lambda env: variable(env, name))


def _count(env: Mapping[str, str], name: str) -> Optional[int]:
    found = variable(env, name)
    return None if found is None else converted(found, to_int)


def _mpi_master(launcher: str, size_env: str, local_size_env: str) -> Reader:
    """Loopback when every rank runs on this host; else an error (MPI publishes no address)."""

    def read(env: Mapping[str, str]) -> Origin:
        size, local_size = _count(env, size_env), _count(env, local_size_env)
        if size in (None, 1) or local_size == size:
            return Origin(LOOPBACK, f"{launcher} on one host",
                          f"{LOOPBACK} ({launcher} started every rank on this host: "
                          f"{local_size_env}={env.get(local_size_env)!r}, {size_env}={env.get(size_env)!r})")
        where = (f"and {local_size_env} is not set, so they may span hosts" if local_size is None else
                 f"with {local_size_env}={env[local_size_env]!r} of them on this host")
        raise ValueError(
            f"{launcher} started {size_env}={env[size_env]!r} ranks {where}, and MPI launchers "
            f"publish no master address: set MASTER_ADDR (or ZCOLLECTIVE_MASTER_ADDR) to the host "
            f"of rank 0 for every rank (see docs/launching.md)")

    return Reader((local_size_env,), read)


def _slurm_size(env: Mapping[str, str]) -> Optional[Origin]:
    found, tasks = variable(env, "SLURM_NTASKS"), _count(env, "SLURM_NTASKS")
    if found is not None and tasks is not None and tasks > 1 and "SLURM_STEP_NODELIST" not in env:
        raise ValueError(
            f"{found.shown} is set, but SLURM_STEP_NODELIST is not: this process is the batch "
            f"script itself, not one of the {tasks} tasks srun starts; start the replicas with "
            f"'srun python ...' (see docs/launching.md)")
    return found


def _slurm_master(env: Mapping[str, str]) -> Origin:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        found = variable(env, name)
        if found is not None:
            try:
                host = first_host(found.raw)
            except ValueError as exc:
                raise ValueError(f"{found.shown} is not a Slurm host list: {exc}") from None
            return Origin(host, f"the first host of {found.source}",
                          f"{host!r}, the first host of {found.shown}")
    raise ValueError(f"Slurm set SLURM_PROCID={env.get('SLURM_PROCID')!r} but neither SLURM_STEP_NODELIST "
                     f"nor SLURM_JOB_NODELIST, which say where rank 0 runs: set MASTER_ADDR (or "
                     f"ZCOLLECTIVE_MASTER_ADDR) to the host of rank 0")


def _slurm_port(env: Mapping[str, str]) -> Optional[Origin]:
    job_id = _count(env, "SLURM_JOB_ID")  # two jobs sharing a node get different ports
    if job_id is None:
        return None
    port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return Origin(port, "environment variable SLURM_JOB_ID",
                  f"port {port} ({SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}, "
                  f"SLURM_JOB_ID={env['SLURM_JOB_ID']!r})")


def _pod_job(env: Mapping[str, str]) -> str:
    """The name of an Indexed Job's pod's Job, when its host name says it ('train' of 'train-2')."""
    index, host = env.get("JOB_COMPLETION_INDEX", "").strip(), env.get("HOSTNAME", "")
    return host[:-len(index) - 1] if index and host.endswith(f"-{index}") else ""


def _kubernetes_job(env: Mapping[str, str]) -> Optional[Origin]:
    job = _pod_job(env)
    return Origin(f"Kubernetes Job {job}", "environment variable HOSTNAME",
                  f"the Job of HOSTNAME={env['HOSTNAME']!r}") if job else None


def _job_named_by(kind: str, name: str) -> Reader:
    """A launcher's job, named in ``name``: '<kind> <value>' ('Slurm job 4242')."""

    def read(env: Mapping[str, str]) -> Optional[Origin]:
        found = variable(env, name)
        return None if found is None else found._replace(raw=f"{kind} {found.raw}")

    return Reader((name,), read)


def _kubernetes_master(env: Mapping[str, str]) -> Origin:
    job = _pod_job(env)
    hint = f" (HOSTNAME={env['HOSTNAME']!r} makes it {job + '-0.<service>'!r})" if job else ""
    raise ValueError(
        f"Kubernetes gives this pod JOB_COMPLETION_INDEX={env.get('JOB_COMPLETION_INDEX')!r} but does "
        f"not say where rank 0 is: set ZCOLLECTIVE_MASTER_ADDR in the Job's manifest to rank 0's "
        f"pod, '<job>-0.<service>'{hint}, with a headless Service <service> "
        f"(see docs/launching.md)")


def _kubernetes_size(env: Mapping[str, str]) -> Origin:
    raise ValueError(
        f"Kubernetes gives this pod JOB_COMPLETION_INDEX={env.get('JOB_COMPLETION_INDEX')!r} but not "
        f"the number of replicas: set ZCOLLECTIVE_NUM_REPLICAS in the Job's manifest to its "
        f"spec.completions (see docs/launching.md)")


@dataclass(frozen=True)
class LaunchedBy:
    """A program that starts a job's replicas and tells each who it is in its environment; asked only
    for settings no argument or variable gave."""

    name: str  # as the README's table and error messages call it
    rank: str  # set in every process it starts: that it is set recognizes the launcher
    readers: Mapping[str, Reader]  # setting name -> how this launcher gives it
    defers_to: tuple[tuple[str, str], ...] = ()  # (ours, theirs) variables another launcher sets alike
    # (srun --mpi=pmi2 sets PMI_RANK): when all agree, the process is that one's, which knows more

    def recognizes(self, env: Mapping[str, str]) -> bool:
        if variable(env, self.rank) is None:
            return False
        agree = all(env.get(ours, "").strip() == env.get(theirs, "").strip()
                    for ours, theirs in self.defers_to)
        return not (self.defers_to and agree)


LAUNCHERS: tuple[LaunchedBy, ...] = (
    LaunchedBy("Open MPI", "OMPI_COMM_WORLD_RANK", {
        "replica_rank": _plain("OMPI_COMM_WORLD_RANK"),
        "num_replicas": _plain("OMPI_COMM_WORLD_SIZE"),
        "local_rank": _plain("OMPI_COMM_WORLD_LOCAL_RANK"),
        "master_addr": _mpi_master("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        "job": _job_named_by("Open MPI job", "PMIX_NAMESPACE"),
    }),
    LaunchedBy("MPICH / Intel MPI (Hydra)", "PMI_RANK", {
        "replica_rank": _plain("PMI_RANK"),
        "num_replicas": _plain("PMI_SIZE"),
        "local_rank": _plain("MPI_LOCALRANKID"),
        "master_addr": _mpi_master("MPICH / Intel MPI (Hydra)", "PMI_SIZE", "MPI_LOCALNRANKS"),
        # (no job: Hydra names it, its KVS, only to a process that asks over PMI)
    }, defers_to=(("PMI_RANK", "SLURM_PROCID"), ("PMI_SIZE", "SLURM_NTASKS"))),
    LaunchedBy("Slurm", "SLURM_PROCID", {
        "replica_rank": _plain("SLURM_PROCID"),
        "num_replicas": Reader(("SLURM_NTASKS",), _slurm_size),
        "local_rank": _plain("SLURM_LOCALID"),
        "master_addr": Reader(("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"), _slurm_master),
        "master_port": Reader(("SLURM_JOB_ID",), _slurm_port),
        "job": _job_named_by("Slurm job", "SLURM_JOB_ID"),  # its steps too (a newcomer's srun)
    }),
    LaunchedBy("Kubernetes Indexed Job", "JOB_COMPLETION_INDEX", {
        "replica_rank": _plain("JOB_COMPLETION_INDEX"),
        "num_replicas": Reader((), _kubernetes_size),
        "master_addr": Reader((), _kubernetes_master),
        "job": Reader(("HOSTNAME",), _kubernetes_job),
    }),
)


def launcher_of(env: Mapping[str, str]) -> Optional[LaunchedBy]:
    """The launcher that started this process: the first of :data:`LAUNCHERS` it recognizes."""
    return next((launcher for launcher in LAUNCHERS if launcher.recognizes(env)), None)


def launcher_variables(setting: str) -> tuple[str, ...]:
    """Every launcher variable that may give ``setting``, in the order of :data:`LAUNCHERS`."""
    return tuple(v for launcher in LAUNCHERS if setting in launcher.readers
                 for v in launcher.readers[setting].variables)
