"""Every option more than one command takes is declared once, in ragcache/cli_options.py: each command that takes it
has the same names and help text, the settings' default or, in its `Own` form, the command's own, which typer shows."""

import typing

import typer.main
from typer.core import TyperGroup, TyperOption
from typer.models import OptionInfo
from typer.testing import CliRunner

from ragcache import cli_options
from ragcache.cli import app


def commands(group: TyperGroup, path: tuple[str, ...] = ()):
    """(`models list`, its command as typer builds it) for every command of the app, the sub-apps' included."""
    for name, command in group.commands.items():
        if isinstance(command, TyperGroup):
            yield from commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def declared() -> dict[str, tuple[frozenset[str], str]]:
    """alias -> (its option names, its help) for each Annotated alias in cli_options."""
    out = {}
    for alias, value in vars(cli_options).items():
        if typing.get_origin(value) is typing.Annotated:
            (info,) = [m for m in value.__metadata__ if isinstance(m, OptionInfo)]
            # typer moves an Annotated option's first name out of `default` once it builds a command with it
            names = {info.default} if isinstance(info.default, str) else set()
            out[alias] = (frozenset(names | set(info.param_decls or ())), info.help)
    return out


def uses() -> list[tuple[str, TyperOption, str]]:
    """(command, option, alias) for every option of every command whose names one of cli_options' aliases takes."""
    aliases = declared()
    shared = {name for names, _ in aliases.values() for name in names}
    found = []
    for command, cmd in commands(typer.main.get_command(app)):
        for param in cmd.params:
            if not isinstance(param, TyperOption) or not shared & set(param.opts):
                continue
            same = [a for a, (names, help) in aliases.items() if names == set(param.opts) and help == param.help]
            assert same, f"`ragcache {command}` declares {'/'.join(param.opts)} itself: {param.help!r}"
            found.append((command, param, same[0]))
    return found


def test_each_shared_option_has_one_help_text_but_for_a_commands_own_default():
    found = uses()
    for alias in ("ModelOpt", "StoreOpt", "DtypeOpt", "DeviceOpt", "KvCodecOpt", "AdapterOpt"):
        assert len({command for command, _, a in found if a == alias}) >= 2, f"{alias} is not shared"
    by_name: dict[str, set[str]] = {}
    for command, param, alias in found:
        settings = "(default: settings" in param.help
        assert settings == (param.default is None), (
            f"`ragcache {command}` {param.opts[0]}: a default of {param.default!r} with the help of {alias}"
        )
        if settings:
            by_name.setdefault(param.opts[0], set()).add(param.help)
    assert set(by_name) == {"--model", "--store", "--dtype", "--device", "--kv-codec", "--adapter"}
    assert all(len(helps) == 1 for helps in by_name.values()), by_name
    assert {command for command, p, _ in found if p.opts[0] == "--store"} >= {
        "compile", "query", "demo", "serve", "calibrate", "store stats", "store ls", "store verify", "store gc",
        "store rm",
    }


def test_a_commands_own_default_is_shown_beside_the_shared_help():
    shown = CliRunner().invoke(app, ["calibrate", "--help"], terminal_width=200)
    said = " ".join(shown.output.split())
    assert shown.exit_code == 0, shown.output
    assert f"{cli_options.STORE} [default: memory:]" in said
    assert f"{cli_options.ADAPTER} [default: installed]" in said
    assert "[default: qwen2.5-coder-0.5b]" in " ".join(
        CliRunner().invoke(app, ["train", "eval", "--help"], terminal_width=200).output.split()
    )
