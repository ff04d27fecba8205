"""The vLLM server arguments `wcache serve` passes on, checked against vLLM's option table before anything starts.

A mistake is one sentence (naming the closest option for a typo), never vLLM's traceback 30 s into start-up.
The check follows vLLM's `FlexibleArgumentParser` where it differs from argparse: `--max_model_len` is
`--max-model-len`, `--compilation-config.mode 3` sets a key of a JSON option, `-O3` is an optimization level.
Values of `--model-loader-extra-config` are checked as wcache's attach options (vLLM keeps a string that is no
JSON object as a string, so a broken one would only fail inside the loader). The launcher adds the model and
`--load-format wcache` itself, so those (and `--config`, a file of more options it cannot see) are refused.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from wcache.attach_options import AttachOptions
from wcache.errors import BadInputError
from wcache.integrations.vllm.announce import DEFAULT_PORT
from wcache.serve.option_table import OptionTable, ServerOption
from wcache.serve.starter import SERVER_MODULE

LOAD_FORMAT = "wcache"
EXTRA_CONFIG = "model_loader_extra_config"
# What the launcher sets itself, by vLLM's dest: the model it resolved, and the load format that attaches.
SET_BY_LAUNCHER = {"model": "give the model as wcache serve's MODEL, before --",
                   "model_tag": "give the model as wcache serve's MODEL, before --",
                   "load_format": "wcache serve always loads with --load-format wcache",
                   "config": "give vLLM's options after -- (wcache serve checks them; it cannot read a --config file)"}
OPTIMIZATION_LEVELS = ("0", "1", "2", "3")
# Options whose value changes the plan the daemons hold: a restart may not change them, ...
PLAN_OPTIONS = ("dtype", "tensor_parallel_size", "quantization", "revision", "tokenizer", "hf_overrides")
# ... and those that say where the server answers, which its record and its clients hold.
FIXED_ON_RESTART = (*PLAN_OPTIONS, "host", "port", "served_model_name")


@dataclass(frozen=True)
class ServerArgs:
    """Checked server arguments: as given, and each option's last value by vLLM's dest (switches: True)."""

    argv: tuple[str, ...]
    values: dict[str, object] = field(default_factory=dict)

    def value(self, dest: str, default: object = None) -> object:
        return self.values.get(dest, default)

    def flags_of(self, dest: str) -> bool:
        return dest in self.values


def _canonical(token: str) -> str:
    """An option's name as vLLM's parser reads it: underscores before any `.` become dashes."""
    head, dot, rest = token.partition(".")
    return head.replace("_", "-") + dot + rest


def _suggestion(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; the closest is {close[0]}." if close else f"; `python -m {SERVER_MODULE} --help` lists them."


def _lookup(name: str, table: OptionTable, by_flag: dict[str, ServerOption]) -> ServerOption:
    if name in by_flag:
        return by_flag[name]
    if table.allow_abbrev and name.startswith("--"):
        prefixed = {by_flag[f].dest: by_flag[f] for f in by_flag if f.startswith(name)}
        if len(prefixed) == 1:
            return next(iter(prefixed.values()))
        if len(prefixed) > 1:
            shown = ", ".join(sorted(f for f in by_flag if f.startswith(name))[:4])
            raise BadInputError(f"{name} is ambiguous among vLLM's options ({shown}).")
    known = sorted(f for f in by_flag if f.startswith("--"))
    raise BadInputError(f"vLLM's server has no option {name}{_suggestion(name, known)}")


def _checked_value(option: ServerOption, flag: str, value: str) -> object:
    if option.kind == "int":
        try:
            return int(value)
        except ValueError:
            raise BadInputError(f"{flag} takes an integer, not {value!r}.") from None
    if option.kind == "float":
        try:
            return float(value)
        except ValueError:
            raise BadInputError(f"{flag} takes a number, not {value!r}.") from None
    if option.choices is not None and value not in option.choices:
        close = difflib.get_close_matches(value, option.choices, n=1)
        hint = f"; the closest is {close[0]}." if close else f"; it takes {', '.join(option.choices)}."
        raise BadInputError(f"{flag} cannot be {value!r}{hint}")
    if option.dest == EXTRA_CONFIG:
        return extra_config(value, flag)
    return value


def extra_config(value: str, flag: str = "--model-loader-extra-config") -> dict[str, object]:
    """`--model-loader-extra-config`'s value as wcache's attach options take it: a JSON object of known options."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise BadInputError(f"{flag} must be a JSON object of wcache options, and {value!r} is not JSON "
                            f"({exc.msg} at character {exc.pos}).") from None
    options = AttachOptions.from_mapping(data, EXTRA_CONFIG)
    return options.to_mapping()


def pinned_restart(extra: object, daemon: str) -> list[str]:
    """The loader options that make a restarted following server attach `daemon` (the version its launcher leases
    now, the last one it was moved to) rather than its MODEL's, the server's other options (`extra`, as checked)
    kept: a version built from a delta is named by its daemon and trusted by config, tokenizer and plan, as a
    switch does. vLLM takes the last of two values of an option."""
    options = dict(extra) if isinstance(extra, dict) else {}
    options.update(daemon=daemon, trust_daemon=True)
    return [f"--{EXTRA_CONFIG.replace('_', '-')}", json.dumps(options)]


def check_server_args(argv: Sequence[str], table: OptionTable) -> ServerArgs:
    """`argv` checked against `table`; BadInputError with one sentence at the first mistake."""
    by_flag = table.by_flag()
    values: dict[str, object] = {}
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token.startswith("-O"):
            # -O3, -O.mode=3, -O 3: vLLM's optimization level, rewritten by its parser; its values vLLM checks.
            if token == "-O" and i < len(tokens) and tokens[i] in OPTIMIZATION_LEVELS:
                i += 1
            continue
        if not token.startswith("-") or token in ("-", "--"):
            raise BadInputError(f"{token!r} is not an option of vLLM's server; wcache serve takes the model before "
                                "-- and vLLM's options (each starting with -) after it.")
        name, has_inline, inline = _canonical(token).partition("=")
        base, dotted, _ = name.partition(".")
        option = _lookup(base, table, by_flag)
        if option.dest in SET_BY_LAUNCHER:
            raise BadInputError(f"{base} is set by wcache serve: {SET_BY_LAUNCHER[option.dest]}.")
        if dotted and option.dest == EXTRA_CONFIG:
            # vLLM would replace the whole object with the keys given this way, past any check here.
            raise BadInputError(f"give wcache's loader options as one JSON object ({base} '{{\"mode\": \"copy\"}}'), "
                                f"not one key at a time ({name}).")
        if dotted:
            if not has_inline:
                if i >= len(tokens):
                    raise BadInputError(f"{token} needs a value.")
                i += 1
            continue  # one key of a JSON option: vLLM merges and checks it
        if option.nargs == "0":
            if has_inline:
                raise BadInputError(f"{base} is a switch and takes no value (drop ={inline}).")
            values[option.dest] = not base.startswith("--no-")
            continue
        given: list[str] = []
        if has_inline:
            given.append(inline)
        elif option.nargs in ("1", "+"):
            if i >= len(tokens) or (tokens[i].startswith("-") and not _is_number(tokens[i])):
                raise BadInputError(f"{base} needs a value.")
            given.append(tokens[i])
            i += 1
        if option.nargs in ("+", "*") or (option.nargs == "?" and not has_inline):
            while i < len(tokens) and not (tokens[i].startswith("-") and not _is_number(tokens[i])):
                given.append(tokens[i])
                i += 1
                if option.nargs == "?":
                    break
        checked = [_checked_value(option, base, value) for value in given]
        values[option.dest] = checked[0] if option.nargs in ("1", "?") and checked else checked
    return ServerArgs(tuple(argv), values)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def check_port_free(args: ServerArgs) -> None:
    """Refuse to start a server whose address another process listens on already: the server would fail to bind
    it after loading, and that process's /health would answer for it meanwhile."""
    host, port = args.value("host"), args.value("port", DEFAULT_PORT)
    try:
        places = socket.getaddrinfo(str(host) if host else None, int(str(port)), type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)
    except (OSError, ValueError):
        return  # an address this cannot resolve: vLLM says what is wrong with it
    for family, kind, protocol, _, address in places:
        with contextlib.suppress(OSError), socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds: TIME_WAIT is no owner
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    where = f"{host} port {port}" if host else f"port {port}"
                    raise BadInputError(f"another process listens on {where} already; stop it or give the "
                                        "server another port (vLLM's --port).") from None


def check_restart(before: ServerArgs, after: ServerArgs) -> None:
    """Refuse new arguments for a restart that would change the daemons' plan or where the server answers."""
    changed = [dest for dest in FIXED_ON_RESTART if before.value(dest) != after.value(dest)]
    if changed:
        raise BadInputError(f"a restart keeps --{changed[0].replace('_', '-')} as wcache serve started with it (the "
                            "daemons' plan and the server's address stay); stop and start wcache serve to change it.")
