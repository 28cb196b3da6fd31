"""Arguments and environment variables to one validated :class:`Config`.

Every setting is one row of :data:`SETTINGS` (argument, type, variables, conversion, default,
check, meaning); :func:`resolve` loops over the rows, and :func:`takes_settings` holds every
signature that takes them to the rows and writes its "Parameters". Precedence (argument,
environment, the launcher of :data:`LAUNCHERS`, default): docs/launching.md. A malformed value
is a ``ValueError`` naming where it came from. Knows nothing of sockets.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from .._limits import (
    DEFAULT_INIT_TIMEOUT_S,
    DEFAULT_LIVENESS_S,
    DEFAULT_OP_TIMEOUT_S,
    DEFAULT_WARN_AFTER_S,
    MAX_JOB_CHARS,
    MAX_LIVENESS_S,
    MIN_LIVENESS_S,
)
from . import _values  # the conversions and checks the table names
from ._launchers import LAUNCHERS as LAUNCHERS
from ._launchers import LOOPBACK as LOOPBACK
from ._launchers import SLURM_PORT_BASE as SLURM_PORT_BASE
from ._launchers import SLURM_PORT_SPAN as SLURM_PORT_SPAN
from ._launchers import LaunchedBy, launcher_of, launcher_variables
from ._launchers import Reader as Reader
from ._values import JOB_NAMERS as JOB_NAMERS
from ._values import LOG_CHOICES, MIN_SECRET_BYTES, Origin, converted, variable
from ._values import SHARED_MEMORY_OFF as SHARED_MEMORY_OFF
from ._values import TORCHRUN_AGENT_STORE as TORCHRUN_AGENT_STORE
from ._values import TORCHRUN_UNNAMED_RUN as TORCHRUN_UNNAMED_RUN

DEFAULT_MASTER_ADDR = "127.0.0.1"  # one machine needs no configuration at all
DEFAULT_MASTER_PORT = 29457  # near torchrun's 29500 range but not on it, so both fit in one job
DEFAULT_RANK = 0  # the only rank of the default single replica
DEFAULT_NUM_REPLICAS = 1  # a script written for many replicas runs unchanged on one
DEFAULT_MAX_FRAME_BYTES = 1 << 31  # 2 GiB: bounds what a stranger's frame makes libzmq allocate
MIN_MAX_FRAME_BYTES = 1024  # a message header with the longest call site (546 bytes) always fits
SECRET_ENV = "ZCOLLECTIVE_SECRET"
SECRET_FILE_ENV = "ZCOLLECTIVE_SECRET_FILE"
DEFAULT_DATA_PLANE = "auto"  # peer to peer across hosts only: on one host the star was faster (benchmarks)
DATA_PLANE_CHOICES = ("auto", "on", "off")
DEFAULT_TREE = "auto"  # a tree from 16 replicas: rank 0's cost per call stops growing (benchmarks/README.md)
TREE_CHOICES = ("auto", "on", "off")
DEFAULT_DATA_PLANE_MIN_BYTES = 1 << 20  # below this an array keeps the star (benchmarks/README.md)
DEFAULT_SHARED_MEMORY_MIN_BYTES = 1 << 14  # from 16 KiB the star is 10-30% slower (benchmarks/README.md)
DEFAULT_MAIL_WINDOW_BYTES = 64 << 20  # what one sender may leave unreceived at one receiver
ALL_INTERFACES = ("*", "0.0.0.0", "::")
JOB_ENV = "ZCOLLECTIVE_JOB"
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Config:
    """A validated group configuration; build it with :func:`resolve`."""

    master_addr: str
    master_port: int
    rank: int
    num_replicas: int
    init_timeout: Optional[float] = DEFAULT_INIT_TIMEOUT_S
    op_timeout: Optional[float] = DEFAULT_OP_TIMEOUT_S
    warn_after: Optional[float] = DEFAULT_WARN_AFTER_S  # a stall is named after this; None: never
    stacks: bool = True  # write every thread's stack to stderr when zcollective-run asks, and on SIGUSR1
    liveness_timeout: float = DEFAULT_LIVENESS_S
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    secret: Optional[bytes] = field(default=None, repr=False)
    bind_addr: Optional[str] = None  # rank 0 binds here; None: the interface of master_addr
    join: bool = False  # a newcomer: wait to be admitted to a running group (grow)
    local_rank: Optional[int] = None  # this replica's index on its host; None: nobody said
    log: Optional[str] = None  # "calls": one line per call on the logger zcollective.calls
    data_plane: str = DEFAULT_DATA_PLANE  # "auto": large arrays peer to peer; "off": star only
    tree: str = DEFAULT_TREE  # "auto": small calls climb a tree in large groups; "off": the star only
    data_plane_min_bytes: int = DEFAULT_DATA_PLANE_MIN_BYTES  # smaller arrays keep the star
    shared_memory_min_bytes: Optional[int] = DEFAULT_SHARED_MEMORY_MIN_BYTES  # None: off
    mail_window_bytes: int = DEFAULT_MAIL_WINDOW_BYTES  # point to point: see the Setting
    local_mail: bool = True  # point to point between ranks on one host: Unix sockets, not ZeroMQ
    port_given: bool = False  # master_port was given: a group of one then serves there, for newcomers
    job: Optional[str] = None  # the job's name, which its JOIN carries; None: nothing names it

    @property
    def endpoint(self) -> str:
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        return f"tcp://{host}:{self.master_port}"

    @property
    def bind_host(self) -> str:
        host = self.bind_addr or self.master_addr
        return "*" if host in ALL_INTERFACES else host


@dataclass(frozen=True)
class Setting:
    """One setting: its argument, where else it comes from, how it is read, what it means."""

    name: str  # the argument of resolve() and initialize(); also what error messages call it
    annotation: str  # the argument's type, spelled alike in every signature
    default: Any
    convert: Callable[[Any], Any]  # raw value -> value; ValueError(what is wrong) if malformed
    doc: str  # its meaning, for docstrings
    check: Optional[Callable[[Any], Optional[str]]] = None  # value -> what is wrong, or None
    env: tuple[str, ...] = ()  # environment variables, in precedence order
    file_env: Optional[str] = None  # after env: a variable naming a file that holds the value
    config_field: str = ""  # the Config field it fills, when not called `name`
    secret: bool = False  # quoted in no message; taken from the environment byte for byte
    none_is_value: bool = False  # an argument of None is a value (no bound), not "look further"
    argument: bool = True  # False: read from the environment only; no signature takes it
    adjust: Optional[Callable[[Origin, Mapping[str, str]], Optional[Origin]]] = None  # env value -> meant

    @property
    def field_name(self) -> str:
        return self.config_field or self.name

    @property
    def signature_default(self) -> Any:
        return self.default if self.none_is_value else None


SETTINGS: tuple[Setting, ...] = (
    Setting("master_addr", "Optional[str]", DEFAULT_MASTER_ADDR, str, check=_values.host_problem,
            env=("ZCOLLECTIVE_MASTER_ADDR", "ADAPTDL_MASTER_ADDR", "MASTER_ADDR"),
            doc="Host name or IP address of rank 0, which hosts the coordinator; every replica "
                "must reach it there."),
    Setting("master_port", "Optional[int]", DEFAULT_MASTER_PORT, _values.to_int, check=_values.port_problem,
            env=("ZCOLLECTIVE_MASTER_PORT", "ADAPTDL_MASTER_PORT", "MASTER_PORT"),
            adjust=_values.beside_torchrun_agent,
            doc="TCP port of the coordinator, the same on every replica (0 only with one "
                "replica, which binds nothing)."),
    Setting("replica_rank", "Optional[int]", DEFAULT_RANK, _values.to_int, config_field="rank",
            env=("ZCOLLECTIVE_REPLICA_RANK", "ADAPTDL_REPLICA_RANK", "RANK"),
            doc="This replica's rank, from 0 to the number of replicas minus 1."),
    Setting("num_replicas", "Optional[int]", DEFAULT_NUM_REPLICAS, _values.to_int, check=_values.at_least(1),
            env=("ZCOLLECTIVE_NUM_REPLICAS", "ADAPTDL_NUM_REPLICAS", "WORLD_SIZE"),
            doc="The number of replicas in the group, the same on every replica."),
    Setting("timeout", "Optional[float]", DEFAULT_INIT_TIMEOUT_S, _values.to_seconds_or_none,
            config_field="init_timeout", none_is_value=True,
            doc="Seconds to wait for every replica to join (``None``: no bound)."),
    Setting("op_timeout", "Optional[float]", DEFAULT_OP_TIMEOUT_S, _values.to_seconds_or_none,
            env=("ZCOLLECTIVE_TIMEOUT",),
            doc="Default timeout, in seconds, of every blocking call; ``math.inf`` (``inf`` in "
                "the environment) for no bound."),
    Setting("warn_after", "Optional[float]", DEFAULT_WARN_AFTER_S, _values.to_seconds_or_zero,
            env=("ZCOLLECTIVE_WARN_AFTER",),
            doc="Seconds a call (or the join) may wait before the ranks it waits for are named "
                "in a warning, on rank 0 and on the ranks waiting (again at 2, 4 and 8 times "
                "this, then when it ends); 0 for no warnings."),
    Setting("liveness_timeout", "Optional[float]", DEFAULT_LIVENESS_S, _values.to_seconds,
            check=_values.liveness_problem, env=("ZCOLLECTIVE_LIVENESS_TIMEOUT",),
            doc=f"Seconds after which a silent peer is declared lost ({MIN_LIVENESS_S:g} to "
                f"{MAX_LIVENESS_S:g})."),
    Setting("max_frame_bytes", "Optional[int]", DEFAULT_MAX_FRAME_BYTES, _values.to_int,
            check=_values.at_least(MIN_MAX_FRAME_BYTES), env=("ZCOLLECTIVE_MAX_FRAME_BYTES",),
            doc="Largest frame (one buffer, such as one numpy array) a peer may send, the same "
                f"on every replica (at least {MIN_MAX_FRAME_BYTES})."),
    Setting("secret", "Union[bytes, str, None]", None, _values.to_secret, check=_values.secret_problem,
            env=(SECRET_ENV,), file_env=SECRET_FILE_ENV, secret=True,
            doc=f"The job's shared secret, at least {MIN_SECRET_BYTES} bytes: every message is "
                "authenticated with it, and nothing from a peer without it is ever unpickled. "
                "Without one, nothing is authenticated: see docs/security.md."),
    Setting("bind_addr", "Optional[str]", None, str, check=_values.bind_problem,
            env=("ZCOLLECTIVE_BIND_ADDR",),
            doc="Where rank 0 listens (``\"*\"``: every interface); by default, on the "
                "interface of ``master_addr``."),
    Setting("join", "Optional[bool]", False, _values.to_bool, env=("ZCOLLECTIVE_JOIN",),
            doc="``True``: this replica is a *newcomer*: it waits at ``master_addr`` to be "
                "admitted to a running group, when its members call :func:`zcollective.grow`; "
                "its rank and the size come from the group then (``replica_rank`` and "
                "``num_replicas`` are not used)."),
    Setting("job", "Optional[str]", None, _values.to_str, check=_values.job_problem,
            env=(JOB_ENV, "ADAPTDL_JOB_ID", "TORCHELASTIC_RUN_ID"), adjust=_values.named_job,
            doc=f"The job's name, the same on every replica (at most {MAX_JOB_CHARS} characters; "
                "``None`` when nothing names it): rank 0 refuses a replica of another job, or of "
                "none when it has one, with an error naming both. It prevents accidents, not "
                "attacks: see docs/security.md."),
    Setting("shared_memory_min_bytes", "Union[int, str, None]", DEFAULT_SHARED_MEMORY_MIN_BYTES,
            _values.to_bytes_or_off, env=("ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES",),
            doc="Numeric arrays (and CPU tensors) of at least this many bytes move through "
                "shared memory between the replicas on one host (``\"off\"``: never). Rank "
                "0's value is the group's; a replica set to ``\"off\"`` keeps its host out."),
    Setting("local_rank", "Optional[int]", None, _values.to_int, check=_values.at_least(0), argument=False,
            env=("ZCOLLECTIVE_LOCAL_RANK", "LOCAL_RANK"),
            doc="This replica's index among the replicas on its host (to pick a GPU, say); "
                "``None`` when nobody said."),
    Setting("log", "Optional[str]", None, str, check=_values.one_of(LOG_CHOICES), argument=False,
            env=("ZCOLLECTIVE_LOG",),
            doc="``calls``: log one line per call (seq, operation, call site, bytes, time "
                "waited) on the logger ``zcollective.calls``; ``None``: no such lines."),
    Setting("data_plane", "Optional[str]", DEFAULT_DATA_PLANE, str, check=_values.one_of(DATA_PLANE_CHOICES),
            argument=False, env=("ZCOLLECTIVE_DATA_PLANE",),
            doc="``auto``: when the replicas are on more than one host, large numeric arrays "
                "reduced elementwise, and large broadcasts, travel between replicas directly (a "
                "ring, a chain); ``on``: also when they share one host; ``off``: every byte goes "
                "through rank 0. Rank 0's setting decides for the group."),
    Setting("tree", "Optional[str]", DEFAULT_TREE, str, check=_values.one_of(TREE_CHOICES),
            argument=False, env=("ZCOLLECTIVE_TREE",),
            doc="``auto``: from 16 replicas, every call's part climbs a tree of ranks (4 "
                "children each) to rank 0, and an allreduce, broadcast or barrier is combined on "
                "the way and its result comes down the same tree, so rank 0's work per call stops "
                "growing with the group (every rank must then pass rank 0's reduce function); "
                "``on``: from 3 replicas; ``off``: every part goes to rank 0, which folds "
                "strictly left to right. Rank 0's setting decides for the group."),
    Setting("data_plane_min_bytes", "Optional[int]", DEFAULT_DATA_PLANE_MIN_BYTES, _values.to_int,
            check=_values.at_least(0), argument=False, env=("ZCOLLECTIVE_DATA_PLANE_MIN_BYTES",),
            doc="Arrays (and broadcast values) smaller than this many bytes keep the star "
                "through rank 0, where small messages are faster."),
    Setting("mail_window_bytes", "Optional[int]", DEFAULT_MAIL_WINDOW_BYTES, _values.to_int,
            check=_values.at_least(1), argument=False, env=("ZCOLLECTIVE_MAIL_WINDOW_BYTES",),
            doc="Point to point: the most bytes one rank's messages may occupy at another rank "
                "before that rank's program receives them (or one message, if larger); a "
                "sender beyond it waits. A receiver holds at most this much from each sender: "
                "the receiver's setting decides (its senders keep to it)."),
    Setting("local_mail", "Optional[bool]", True, _values.to_bool, argument=False,
            env=("ZCOLLECTIVE_LOCAL_MAIL",),
            doc="``1``: point-to-point messages (and the tree's) between replicas on one host go "
                "over Unix sockets with no name on any filesystem (docs/protocol.md, *Point to point*), "
                "not ZeroMQ's TCP; ``0``: always ZeroMQ. A pair of replicas uses it if both offer it."),
    Setting("stacks", "Optional[bool]", True, _values.to_bool, argument=False, env=("ZCOLLECTIVE_STACKS",),
            doc="``1``: write every thread's stack to stderr when zcollective-run asks (for the "
                "ranks a stall names, and every rank when it gets SIGUSR1 itself; through a file, "
                "not a signal), and on SIGUSR1 unless the program handles SIGUSR1 when the group "
                "starts; ``0``: neither, and SIGUSR1 is left alone."),
)

ARGUMENTS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.argument)


# -- resolving ---------------------------------------------------------------


def _from_env(s: Setting, env: Mapping[str, str]) -> Optional[Origin]:
    for name in s.env:
        found = variable(env, name, s.secret)
        if found is not None:
            return found
    path = env.get(s.file_env) if s.file_env else None
    if path:
        source = f"the file {path!r} named by {s.file_env}"
        try:
            with open(path, "rb") as f:
                return Origin(f.read().strip(), source, source)
        except OSError as exc:
            raise ValueError(f"cannot read {source}: {exc.strerror}") from None
    return None


def _value(s: Setting, arg: Any, env: Mapping[str, str],
           launcher: Optional[LaunchedBy]) -> tuple[Any, Origin]:
    """The setting's value and its origin, found in the order of precedence."""
    if arg is not None or s.none_is_value:
        source = f"argument {s.name}"
        found: Optional[Origin] = Origin(arg, source, source if s.secret else f"{source}={arg!r}")
    else:
        found = _from_env(s, env)
        if found is not None and s.adjust is not None:
            found = s.adjust(found, env)
        if found is None and launcher is not None and s.name in launcher.readers:
            found = launcher.readers[s.name].read(env)
    if found is None:
        return s.default, Origin(s.default, "the default", "the default")
    value = converted(found, s.convert)
    problem = s.check(value) if s.check else None
    if problem:
        raise ValueError(f"{found.shown} {problem}")
    return value, found


def _rank_in_range(c: Config, origins: Mapping[str, Origin]) -> None:
    if not 0 <= c.rank < c.num_replicas and not c.join:  # (a newcomer is given both)
        raise ValueError(
            f"{origins['replica_rank'].shown} is out of range: ranks run from 0 to {c.num_replicas - 1} "
            f"for num_replicas={c.num_replicas} (from {origins['num_replicas'].source})"
        )


def _port_zero_only_alone(c: Config, origins: Mapping[str, Origin]) -> None:
    # one replica binds nothing, so adaptdl's standalone port 0 is fine
    if c.master_port == 0 and c.num_replicas > 1:
        raise ValueError(
            f"{origins['master_port'].source}=0 cannot be used with num_replicas={c.num_replicas}: "
            f"rank 0 must listen on a port that every replica is given; pass the same "
            f"master_port everywhere")


def _alone_by_omission(c: Config, origins: Mapping[str, Origin]) -> None:
    # a group of one by default though where the group is was set: the others would wait (issue 26)
    if c.num_replicas == 1 and origins["num_replicas"].source == "the default" and not c.join:
        given = [origins[name].source for name in ("replica_rank", "master_port")
                 if origins[name].source != "the default"]
        if given:
            logging.getLogger("zcollective").warning(
                "zcollective: running alone (a group of one): num_replicas is not set (argument "
                "num_replicas, ZCOLLECTIVE_NUM_REPLICAS or a launcher's), though %s is; other "
                "replicas will not find this one (a newcomer, with join=True, may: grow())",
                " and ".join(given))


# -- signatures --------------------------------------------------------------

_ENV_DOC = ("env : Mapping[str, str], optional\n"
           "    The environment to read instead of ``os.environ``.")


def _shown(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"``{value}``"


def _type_doc(annotation: str) -> str:
    """``Optional[int]`` -> ``int, optional``; ``Union[bytes, str, None]`` -> ``bytes or str, optional``."""
    inner = annotation.split("[", 1)[1].rstrip("]")
    return " or ".join(t.strip() for t in inner.split(",") if t.strip() != "None") + ", optional"


def _parameter_doc(s: Setting, name: str) -> str:
    if s.none_is_value:
        where = f"Default {_shown(s.default)}."
    else:
        places = [f"``{n}``" for n in s.env]
        if s.file_env:
            places.append(f"the file named by ``{s.file_env}``")
        launched = ", ".join(f"``{n}``" for n in launcher_variables(s.name))
        if launched:
            places.append(f"the launcher that started this process ({launched}; see "
                          f"docs/launching.md)")
        default = "" if s.default is None else f"; default {_shown(s.default)}"  # doc says what None means
        where = f"Left ``None``: read from {', else '.join(places)}{default}."
    text = textwrap.fill(f"{s.doc} {where}", width=88, initial_indent="    ",
                         subsequent_indent="    ")
    return f"{name} : {_type_doc(s.annotation)}\n{text}"


def _check_signature(func: Callable[..., Any], named: list[tuple[str, Setting]]) -> None:
    # annotations are compared as written: every module here has `from __future__ import annotations`
    params = inspect.signature(func).parameters.values()
    got = [(p.name, p.annotation, p.default) for p in params if p.name not in ("self", "env")]
    want = [(name, s.annotation, s.signature_default) for name, s in named]
    for i, (has, should) in enumerate(itertools.zip_longest(got, want)):
        if has != should:
            raise TypeError(f"{func.__qualname__} must take exactly the settings of "
                            f"zcollective.config.SETTINGS, in order: (name, annotation, default) "
                            f"of argument {i} is {has}, not {should}")


def takes_settings(**renamed: str) -> Callable[[F], F]:
    """Check at import that a function takes every setting of :data:`ARGUMENTS` in order, with their
    annotations and defaults (names: ``renamed``, else their own); add their "Parameters" to its docstring.

    Raises
    ------
    TypeError
        The signature does not match :data:`SETTINGS`.
    """
    named = [(renamed.get(s.name, s.name), s) for s in ARGUMENTS]

    def decorate(func: F) -> F:
        _check_signature(func, named)
        entries = [_parameter_doc(s, name) for name, s in named]
        if "env" in inspect.signature(func).parameters:
            entries.append(_ENV_DOC)
        section = "Parameters\n----------\n" + "\n".join(entries) + "\n\n"
        doc = inspect.cleandoc(func.__doc__ or "") + "\n\n"
        head, raises, tail = doc.partition("Raises\n------\n")
        func.__doc__ = (head + section + raises + tail).rstrip() + "\n"
        return func

    return decorate


POSITIONAL_ARGUMENTS = 4  # master_addr, master_port, rank, size: adaptdl's order; the rest by name


def _signed(func: F) -> F:
    """Give ``resolve`` its signature from :data:`ARGUMENTS` (public functions spell theirs out)."""
    by_position, by_name = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(s.name, by_position if i < POSITIONAL_ARGUMENTS else by_name,
                                default=s.signature_default, annotation=s.annotation)
              for i, s in enumerate(ARGUMENTS)]
    params.append(inspect.Parameter("env", by_name, default=None, annotation="Optional[Mapping[str, str]]"))
    func.__signature__ = inspect.Signature(params, return_annotation="Config")  # type: ignore[attr-defined]
    return func


@takes_settings()
@_signed
def resolve(*args: Any, **kwargs: Any) -> Config:
    """Build a :class:`Config` from arguments, then the environment (its
    variables, then the launcher's), then defaults.

    Raises
    ------
    ValueError
        A value is malformed or out of range; the message names the argument
        or environment variable it came from.
    """
    try:
        bound = inspect.signature(resolve).bind(*args, **kwargs)
    except TypeError as exc:  # as Python words it for a function of its own
        raise TypeError(f"resolve() {exc}") from None
    bound.apply_defaults()
    given = bound.arguments
    env = given.pop("env")
    env = os.environ if env is None else env
    launcher = launcher_of(env)
    values: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    for s in SETTINGS:
        values[s.field_name], origins[s.name] = _value(s, given.get(s.name), env, launcher)
    config = Config(**values, port_given=origins["master_port"].source != "the default")
    for check in (_rank_in_range, _port_zero_only_alone, _alone_by_omission):
        check(config, origins)
    return config
