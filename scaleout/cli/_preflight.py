"""The launcher's own inputs, checked before any rank is spawned: the rendezvous address and port,
the command after ``--``, and the environment knobs every rank reads.

Each check is bounded in time: a name lookup gets :data:`LOOKUP_TIMEOUT_S`, nothing connects to
anything (an address is judged local by binding to it, which the kernel answers at once). Without
them a master address that is not this machine's, or a host that does not resolve, was a silent
wait of ``train.init_timeout_s`` (600 s) in every rank.

One function per check, each raising :class:`~scaleout.errors.UserError` with one line; the
``scaleout launch`` command calls :func:`check_local_launch`, and other launchers can call the parts
that apply to them.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping, Sequence

from scaleout.env.addr import LOOKUP_TIMEOUT_S, interfaces, resolve_within
from scaleout.env.knobs import check_rank_env
from scaleout.errors import UserError, excerpt


def _bindable(addr: str, port: int = 0) -> OSError | None:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # a port in TIME_WAIT is free for a new listener; one with a listener is not
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
    except OSError as exc:
        return exc
    return None


def check_master_local(addr: str, flag: str = "--master-addr") -> str:
    """``addr`` resolves, in bounded time, to an address of this machine (every rank of a local
    launch runs here and the rendezvous store listens here). Returns that address."""
    shown = excerpt(addr)
    found = resolve_within(addr)
    if found is None:
        raise UserError(
            f"{flag}={shown}: no answer from the name resolver in {LOOKUP_TIMEOUT_S:g} s; expected"
            " an address of this machine (e.g. 127.0.0.1)"
        )
    if not found:
        raise UserError(f"{flag}={shown}: does not resolve; expected an address of this machine")
    for ip in found:
        if _bindable(ip) is None:
            return ip
    mine = sorted({a for _, a, _ in interfaces() if a})
    raise UserError(
        f"{flag}={shown}: not an address of this machine (a local launch starts every rank here);"
        f" expected one of {', '.join(mine) or '127.0.0.1'}"
    )


def check_port_free(port: int, flag: str = "--master-port") -> None:
    """Nothing listens on ``port`` here (the rendezvous store binds it on every interface)."""
    err = _bindable("0.0.0.0", port)
    if err is None:
        return
    if err.errno == errno.EADDRINUSE:
        raise UserError(
            f"{flag}={port}: in use on this machine (another job's rendezvous?); expected a free "
            "port, or leave it out for a free one"
        )
    if err.errno == errno.EACCES:
        raise UserError(f"{flag}={port}: a privileged port this user may not listen on")


def check_program(cmd: Sequence[str]) -> None:
    """The program after ``--`` exists and can run: a path is a file with the execute bit, a .py
    file is readable (scaleout subcommands are the CLI's to check: :func:`scaleout.cli.preflight`).
    """
    if not cmd:
        return
    prog = cmd[0]
    if prog in ("scaleout", "python", "python3"):
        return
    if prog.endswith(".py"):
        if not os.path.isfile(prog):
            raise UserError(f"command {excerpt(prog)}: no such file; expected a Python script")
        if not os.access(prog, os.R_OK):
            raise UserError(f"command {excerpt(prog)}: not readable by this user")
        return
    if os.sep in prog:
        if os.path.isdir(prog):
            raise UserError(f"command {excerpt(prog)}: is a folder; expected a program")
        if not os.path.exists(prog):
            raise UserError(f"command {excerpt(prog)}: no such file; expected a program")
        if not os.access(prog, os.X_OK):
            raise UserError(
                f"command {excerpt(prog)}: not executable (chmod +x, or run it with its "
                "interpreter, e.g. -- bash script.sh)"
            )


def check_local_launch(
    cmd: Sequence[str], master_addr: str, master_port: int | None, env: Mapping[str, str]
) -> None:
    """Everything a local launch (every rank on this machine) can know before it spawns."""
    check_program(cmd)
    check_rank_env(env)
    check_master_local(master_addr)
    if master_port is not None:
        check_port_free(master_port)
