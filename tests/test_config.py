"""Arguments, environment variables and their precedence; malformed values;
one table of settings behind every signature, docstring and the README."""

import importlib
import inspect
import logging
import pathlib
import re

import pytest

import zcollective as zc
from zcollective.config import (
    ARGUMENTS,
    DEFAULT_MASTER_PORT,
    LAUNCHERS,
    SETTINGS,
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    launcher_variables,
    resolve,
    takes_settings,
)

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_defaults_are_one_replica_on_loopback():
    c = resolve(env={})
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == (
        "127.0.0.1", DEFAULT_MASTER_PORT, 0, 1)


def test_precedence_argument_then_zcollective_then_adaptdl_then_torchrun():
    env = {"MASTER_ADDR": "torch", "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2"}
    c = resolve(env=env)
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == ("torch", 1, 1, 2)
    env.update(ADAPTDL_MASTER_ADDR="adaptdl", ADAPTDL_MASTER_PORT="2",
               ADAPTDL_REPLICA_RANK="2", ADAPTDL_NUM_REPLICAS="3")
    c = resolve(env=env)
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == ("adaptdl", 2, 2, 3)
    env.update(ZCOLLECTIVE_MASTER_ADDR="zc", ZCOLLECTIVE_MASTER_PORT="3",
               ZCOLLECTIVE_REPLICA_RANK="3", ZCOLLECTIVE_NUM_REPLICAS="4")
    c = resolve(env=env)
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == ("zc", 3, 3, 4)
    c = resolve("arg", 4, 0, 5, env=env)
    assert (c.master_addr, c.master_port, c.rank, c.num_replicas) == ("arg", 4, 0, 5)


def test_empty_variables_count_as_unset():
    c = resolve(env={"ZCOLLECTIVE_NUM_REPLICAS": "", "WORLD_SIZE": "3", "RANK": "2"})
    assert c.num_replicas == 3


@pytest.mark.parametrize("kwargs, env, text", [
    ({}, {"ZCOLLECTIVE_REPLICA_RANK": "abc", "ZCOLLECTIVE_NUM_REPLICAS": "2"},
     "environment variable ZCOLLECTIVE_REPLICA_RANK='abc' is not an integer"),
    ({}, {"RANK": "4", "WORLD_SIZE": "4"},
     "environment variable RANK='4' is out of range: ranks run from 0 to 3 for num_replicas=4 "
     "(from environment variable WORLD_SIZE)"),
    ({"replica_rank": -1, "num_replicas": 2}, {}, "argument replica_rank=-1 is out of range"),
    ({"num_replicas": 0}, {}, "argument num_replicas=0 must be at least 1"),
    ({"master_port": 70000}, {}, "argument master_port=70000 is not a TCP port"),
    ({}, {"ADAPTDL_MASTER_PORT": "http"}, "ADAPTDL_MASTER_PORT='http' is not an integer"),
    ({"master_addr": "a b"}, {}, "not a host name"),
    ({"master_addr": "-foo"}, {}, "not a host name"),
    ({"replica_rank": True}, {}, "not an integer"),
    ({}, {"ZCOLLECTIVE_TIMEOUT": "soon"}, "ZCOLLECTIVE_TIMEOUT='soon' is not a number"),
    ({"liveness_timeout": 0.2}, {}, "below the minimum"),
    ({}, {"ZCOLLECTIVE_LIVENESS_TIMEOUT": "inf"}, "ZCOLLECTIVE_LIVENESS_TIMEOUT='inf' is above the maximum"),
    ({"timeout": -1}, {}, "argument timeout=-1 must be a positive"),
    ({"max_frame_bytes": 100}, {}, "argument max_frame_bytes=100 must be at least 1024"),
    ({}, {"ZCOLLECTIVE_MAX_FRAME_BYTES": "2G"}, "ZCOLLECTIVE_MAX_FRAME_BYTES='2G' is not an integer"),
    ({"bind_addr": "a b"}, {}, "argument bind_addr='a b' is not an address to bind"),
    ({}, {"ZCOLLECTIVE_LIVENESS_TIMEOUT": "none"},
     "environment variable ZCOLLECTIVE_LIVENESS_TIMEOUT='none' is not a number of seconds"),
    ({"master_port": 0, "num_replicas": 2}, {},
     "argument master_port=0 cannot be used with num_replicas=2"),
    ({"secret": 1234}, {}, "argument secret must be bytes or str, not int"),
    ({}, {"ZCOLLECTIVE_SECRET": "short"}, "environment variable ZCOLLECTIVE_SECRET is 5 bytes long"),
    ({"job": 4242}, {}, "argument job=4242 must be a str, not int"),
    ({"job": " "}, {}, "argument job=' ' is empty"),
    ({"job": "a\nb"}, {}, "argument job='a\\nb' has characters that do not print"),
    ({}, {"ZCOLLECTIVE_JOB": "j" * 129}, f"environment variable ZCOLLECTIVE_JOB='{'j' * 129}' is 129 "
                                         f"characters long; use at most 128"),
])
def test_malformed_values_name_their_source(kwargs, env, text):
    with pytest.raises(ValueError) as info:
        resolve(env=env, **kwargs)
    assert text in str(info.value)


def test_timeouts_accept_none_and_inf():
    c = resolve(op_timeout=None, timeout=None, env={"ZCOLLECTIVE_TIMEOUT": "inf"})
    assert c.op_timeout is None and c.init_timeout is None
    assert resolve(op_timeout=5, env={}).op_timeout == 5.0


def test_secrets_are_never_quoted_and_taken_byte_for_byte():
    with pytest.raises(ValueError) as info:
        resolve(env={"ZCOLLECTIVE_SECRET": "hunter2"})
    assert "hunter2" not in str(info.value)
    assert resolve(env={"ZCOLLECTIVE_SECRET": " " * 16}).secret == b" " * 16  # not "unset"


def test_secret_file_comes_after_the_secret_variable(tmp_path):
    path = tmp_path / "job.secret"
    path.write_bytes(b"f" * 16 + b"\n")
    assert resolve(env={"ZCOLLECTIVE_SECRET_FILE": str(path)}).secret == b"f" * 16
    env = {"ZCOLLECTIVE_SECRET_FILE": str(path), "ZCOLLECTIVE_SECRET": "v" * 16}
    assert resolve(env=env).secret == b"v" * 16
    assert resolve(secret="a" * 16, env=env).secret == b"a" * 16


def test_the_job_is_the_argument_else_its_variables_else_unnamed():
    """Each source of the job's name (the launchers': test_launch_env.py). adaptdl's and
    torchrun's ids are called what they are, so an error says whose name it is."""
    assert resolve(env={}).job is None
    env = {"TORCHELASTIC_RUN_ID": "none"}  # torchrun's default id names no run
    assert resolve(env=env).job is None
    env["TORCHELASTIC_RUN_ID"] = "8f3c"
    assert resolve(env=env).job == "torchrun run 8f3c"
    env["ADAPTDL_JOB_ID"] = "default/train"
    assert resolve(env=env).job == "adaptdl job default/train"
    env["ZCOLLECTIVE_JOB"] = " train-a "  # the user's own name, as it is (a variable is stripped)
    assert resolve(env=env).job == "train-a"
    assert resolve(job="train b", env=env).job == "train b"


# -- one table of settings ---------------------------------------------------


def _arguments(func):
    return [p for p in inspect.signature(func).parameters if p not in ("self", "env")]


def test_initialize_and_group_pass_every_setting_straight_to_resolve(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def spy(*args, **kwargs):
        seen.append(inspect.signature(resolve).bind(*args, **kwargs).arguments)
        raise Stop

    group_module = importlib.import_module("zcollective._group")  # zc._group is the default group
    monkeypatch.setattr(group_module, "resolve", spy)
    markers = {s.name: object() for s in ARGUMENTS}  # one distinct value per setting
    with pytest.raises(Stop):
        zc.initialize(**markers)
    with pytest.raises(Stop):
        zc.Group(**dict(zip(_arguments(zc.Group.__init__), markers.values(), strict=True)))
    assert len(seen) == 2
    for arguments in seen:
        assert all(arguments[name] is marker for name, marker in markers.items())


def test_every_signature_and_docstring_lists_the_settings():
    for func in (resolve, zc.initialize, zc.Group.__init__):
        assert len(_arguments(func)) == len(ARGUMENTS)
        for name in _arguments(func):
            assert f"\n{name} : " in func.__doc__, (func, name)
        for s in ARGUMENTS:
            names = [*s.env, *launcher_variables(s.name)]
            assert all(f"``{env}``" in func.__doc__ for env in names), (func, s.name)
    assert _arguments(zc.initialize) == _arguments(resolve) == [s.name for s in ARGUMENTS]
    assert [s.name for s in SETTINGS if not s.argument] == ["local_rank", "log", "data_plane", "tree",
                                                         "data_plane_min_bytes", "mail_window_bytes",
                                                         "local_mail", "stacks"]  # never passed


def test_a_signature_that_leaves_the_settings_table_is_refused_at_import():
    def initialize(master_addr=None, master_port=None, replica_rank=None, num_replicas=None):
        """Missing timeout and the rest."""

    with pytest.raises(TypeError, match="must take exactly the settings"):
        takes_settings()(initialize)


def _readme_section(title):
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _tables(section):
    """Each table of a README section, as rows of cells (header and rule left out)."""
    tables, rows = [], []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            tables.append(rows[2:])
            rows = []
    return tables


def _code(cell):
    return re.findall(r"`([^`]*)`", cell)


def _env_names(cell):
    return [c for c in _code(cell) if re.fullmatch(r"[A-Z][A-Z0-9_]*", c)]


def _as_readme_writes(value):
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def test_readme_configuration_table_is_the_settings_table():
    rows = _tables(_readme_section("Configuration"))[0]
    assert [(_code(argument) or [None])[0] for _, argument, _, _ in rows] == [
        s.name if s.argument else None for s in SETTINGS]
    group_names = dict(zip([s.name for s in ARGUMENTS], _arguments(zc.Group.__init__), strict=True))
    for (label, argument, env, default), s in zip(rows, SETTINGS, strict=True):
        if group_names.get(s.name, s.name) != s.name:
            assert f"`{group_names[s.name]}` on `Group`" in argument, label
        expected = [*s.env, *([s.file_env] if s.file_env else []), *launcher_variables(s.name)]
        assert _env_names(env) == expected, label
        if s.default is None:
            assert default.startswith("none"), label
        else:
            assert _code(default)[0] == _as_readme_writes(s.default), label


def test_readme_launchers_table_is_the_launchers_table():
    """Row by row, in precedence order: each launcher, what recognizes it, and the
    variables it reads for each setting (the settings' own variables, which the
    text names as what a manifest or user sets, aside)."""
    own = {name for s in SETTINGS for name in s.env}
    rows = _tables(_readme_section("Configuration"))[1]
    assert [row[0].split(" (`")[0] for row in rows] == [launcher.name for launcher in LAUNCHERS]
    columns = ["replica_rank", "num_replicas", "local_rank", "master_addr", "master_port", "job"]
    for (_, recognized, *cells), launcher in zip(rows, LAUNCHERS, strict=True):
        ours, theirs = [o for o, _ in launcher.defers_to], [t for _, t in launcher.defers_to]
        assert _env_names(recognized) == list(dict.fromkeys([launcher.rank, *ours, *theirs]))
        for setting, cell in zip(columns, cells, strict=True):
            reader = launcher.readers.get(setting)
            read = [name for name in _env_names(cell) if name not in own]
            assert read == list(reader.variables if reader else ()), (launcher.name, setting)
            if reader is None:
                assert cell in ("none", "default"), (launcher.name, setting)
    slurm_port = rows[[launcher.name for launcher in LAUNCHERS].index("Slurm")][-2]
    assert slurm_port == f"{SLURM_PORT_BASE} + `SLURM_JOB_ID` % {SLURM_PORT_SPAN}"


def test_readme_api_row_of_initialize_is_its_signature():
    sig = inspect.signature(zc.initialize)
    plain = sig.replace(return_annotation=sig.empty, parameters=[
        p.replace(annotation=p.empty, default=int(p.default) if isinstance(p.default, float)
                  else p.default) for p in sig.parameters.values()])
    assert f"| `initialize{plain}` |" in _readme_section("API")


def test_a_rank_0_told_its_rank_or_port_but_not_the_size_warns_that_it_runs_alone(caplog):
    """Forgetting ZCOLLECTIVE_NUM_REPLICAS on rank 0 only: it ran alone and exited 0 while rank 1
    waited out its join timeout, and nothing named the likely cause (issue 26)."""
    with caplog.at_level(logging.WARNING, logger="zcollective"):
        resolve(env={"ZCOLLECTIVE_REPLICA_RANK": "0", "ZCOLLECTIVE_MASTER_PORT": "29999"})
    assert "running alone (a group of one): num_replicas is not set" in caplog.text
    assert "environment variable ZCOLLECTIVE_REPLICA_RANK" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zcollective"):
        resolve(env={})  # a script run on its own: nothing to warn about
        resolve(env={"ZCOLLECTIVE_NUM_REPLICAS": "1", "ZCOLLECTIVE_REPLICA_RANK": "0"})
    assert caplog.text == ""
