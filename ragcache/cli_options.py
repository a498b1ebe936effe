"""The options more than one command takes, each declared once: its names, type and help text, for ragcache/cli.py,
ragcache/store_cli.py and ragcache/train/cli.py alike (tests/test_cli_options.py holds every command to them).

An option left out falls back to the settings (RAGCACHE_*, then ragcache.toml, then the built-in default: `ragcache
config` shows them), which its help says as "default: settings". A command whose default is its own takes the `Own`
form: the same help without that phrase, and typer shows the command's default beside it."""

from __future__ import annotations

import functools
import inspect
import re
import typing
from typing import Annotated, Literal

import typer

from .console import fail
from .errors import RagCacheError
from .settings import DEFAULT_MODEL, DEFAULT_STORE, LinkKnobs
from .store.codec import CODECS

MODEL = "built-in name (`ragcache models list`), transformers directory or hub id"
STORE = "memory:[SIZE], gpu:[SIZE|N%] (CUDA), disk:PATH, redis://HOST:PORT/DB, or tiers joined by '+'"
ADAPTER = "a LoRA directory `ragcache train link` wrote, none (the base model) or installed"

ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help=f"{MODEL} (default: settings, {DEFAULT_MODEL})")]
OwnModelOpt = Annotated[str, typer.Option("--model", "-m", help=MODEL)]
StoreOpt = Annotated[str | None, typer.Option("--store", "-s", help=f"{STORE} (default: settings, {DEFAULT_STORE})")]
OwnStoreOpt = Annotated[str, typer.Option("--store", "-s", help=STORE)]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="auto | float32 | bfloat16 | float16 (default: settings, auto: bfloat16 on CUDA from Ampere on "
        "(float16 before) and on CPUs with bf16 instructions, else float32)",
    ),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="auto | cpu | cuda: the first GPU the process sees, picked with "
        "CUDA_VISIBLE_DEVICES (default: settings, auto: CUDA where torch sees a GPU)",
    ),
]
KvCodecOpt = Annotated[
    str | None,
    typer.Option(
        "--kv-codec",
        help=f"how chunk K/V are stored: auto | {' | '.join(CODECS)} (default: settings, auto: int8 on CPU and "
        "CUDA; int4 takes half int8's bytes, README: KV codecs)",
    ),
]
AdapterOpt = Annotated[
    str | None,
    typer.Option(
        "--adapter",
        help=f"{ADAPTER} (default: settings, installed: the model's installed adapter where it is calibrated)",
    ),
]
OwnAdapterOpt = Annotated[str, typer.Option("--adapter", help=ADAPTER)]
JsonlOpt = Annotated[str, typer.Option("--jsonl", help="field holding the text in .jsonl files")]

# training's own precision and device, which the serving commands' values do not fit (no float16, auto picks CUDA)
TrainDtypeOpt = Annotated[str, typer.Option("--dtype", help="float32 | bfloat16")]
TrainDeviceOpt = Annotated[
    str, typer.Option("--device", help="auto | cpu | cuda (the first GPU the process sees: CUDA_VISIBLE_DEVICES)")
]


def link_options(command=None, /, only: tuple[str, ...] | None = None, **defaults):
    """One --option per link knob (settings.LinkKnobs, with its help text), handed to the command whole as its
    `link` parameter: a knob declared there reaches every command that takes link knobs, with no edit here.
    `defaults`: a command's own default for a knob (`@link_options(algorithm="naive")`), which typer shows in place
    of the settings' default its help names; `only`: the knobs a command reads, where it reads some (training)."""
    if command is None:
        return functools.partial(link_options, only=only, **defaults)
    names = list(LinkKnobs.model_fields) if only is None else list(only)
    unknown = (set(defaults) | set(names)) - set(LinkKnobs.model_fields)
    if unknown:
        raise TypeError(f"link_options: no link knob {sorted(unknown)}")
    knobs = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=defaults.get(name),
            annotation=Annotated[
                _option_type(field.annotation) | None,
                typer.Option(help=_without_default(field.description) if name in defaults else field.description),
            ],
        )
        for name, field in LinkKnobs.model_fields.items()
        if name in names
    ]
    signature = inspect.signature(command, eval_str=True)  # typer reads a __signature__ as it stands
    others = [p for p in signature.parameters.values() if p.name != "link"]

    @functools.wraps(command)
    def with_knobs(*args, **kwargs):
        try:  # a knob out of range, or an algorithm of no such name, fails here, before the model loads
            link = LinkKnobs.of(**{name: kwargs.pop(name) for name in names})
            if link.algorithm is not None:
                from .linker import algorithm

                algorithm(link.algorithm)
        except RagCacheError as exc:
            fail(exc)
        return command(*args, link=link, **kwargs)

    with_knobs.__signature__ = signature.replace(parameters=[*others, *knobs])  # type: ignore[attr-defined]
    return with_knobs


def _without_default(help: str | None) -> str | None:
    """A knob's help without the clause naming its settings' default: "link algorithm (README: Algorithms; default:
    focus)" -> "link algorithm (README: Algorithms)"."""
    if help is None:
        return None
    return re.sub(r"; default: [^)]*\)", ")", re.sub(r" \(default: [^)]*\)", "", help))


def _option_type(annotation) -> type:
    """A knob's type as a command-line option takes it: the type it allows besides None, text for a choice."""
    base = next(a for a in typing.get_args(annotation) or (annotation,) if a is not type(None))
    return str if typing.get_origin(base) is Literal else base
