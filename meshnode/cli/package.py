"""``meshnode package``: write, validate and fetch layer packages.

Each command builds a frozen config and calls one ``run_*`` function; bad input (an unknown
reference, an invalid package, a failed fetch) prints one line per problem on stderr and
exits with status 2, without a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import typer
from meshnode_packaging.errors import DamagedPackage, InvalidPackage, PackageError
from meshnode_packaging.fetch import Materializer
from meshnode_packaging.manifest import Part
from meshnode_packaging.package import PackageSource
from meshnode_packaging.reference import LocalPackage, LocalSource, RemotePackage
from meshnode_packaging.refs import check_local_package, open_ref, resolve
from meshnode_packaging.remote import RangedSource
from meshnode_packaging.sources import ModelSource, SourceError
from meshnode_packaging.validate import validate_package
from meshnode_packaging.writer import speculative_block, write_package
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from meshnode.cli import app

package_app = typer.Typer(help="Write, validate and fetch layer packages.", no_args_is_help=True)
app.add_typer(package_app, name="package")

EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class WriteConfig:
    """``meshnode package write``."""

    source: str
    out: Path
    dtype: Literal["f16", "bf16", "f32"] | None = None
    speculative_default: str | None = None
    strategies: tuple[str, ...] = ()
    model_id: str | None = None


@dataclass(frozen=True)
class FetchConfig:
    """``meshnode package fetch``."""

    ref: str
    part: Part
    cache_dir: Path | None = None


def _fail(lines: list[str]) -> typer.Exit:
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    return typer.Exit(EXIT_BAD_INPUT)


@contextmanager
def _bar(label: str, *, bytes_: bool) -> Iterator[Callable[[int, int], None]]:
    columns = [TextColumn(label), BarColumn()]
    columns += (
        [DownloadColumn(), TransferSpeedColumn()]
        if bytes_
        else [TextColumn("{task.completed:.0f}/{task.total:.0f}")]
    )
    with Progress(*columns, transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def run_write(config: WriteConfig) -> Path:
    """Write the package; return its folder."""
    source, repo, commit = _write_source(config.source)
    speculative = None
    if config.speculative_default is not None or config.strategies:
        if config.speculative_default is None:
            raise ValueError("--strategy needs --speculative-default NAME")
        speculative = speculative_block(config.speculative_default, list(config.strategies))
    with _bar("writing", bytes_=False) as progress:
        write_package(
            source,
            config.out,
            dtype=config.dtype,
            speculative=speculative,
            model_id=config.model_id,
            source_repo=repo,
            source_revision=commit,
            progress=progress,
        )
    return config.out


def _write_source(ref: str) -> tuple[Path | ModelSource, str | None, str | None]:
    """What ``package write`` reads: a local GGUF or checkpoint, or a hub GGUF or
    safetensors repo (fetched whole, by ranges); with the repo and commit it came from."""
    target = resolve(ref)
    if isinstance(target, LocalSource):
        return target.path, None, None
    if isinstance(target, RemotePackage) and target.repo is not None:
        with _bar("fetching", bytes_=True) as progress:
            source = open_ref(target, None, progress=progress)
        if isinstance(source, RangedSource):
            return source, target.repo, source.commit
    raise PackageError(f"{ref!r} is a package already; write needs a GGUF or checkpoint")


def run_fetch(config: FetchConfig) -> Path:
    """Materialize the part; return the (partial) package folder."""
    target = resolve(config.ref)
    if isinstance(target, LocalPackage):
        # Already here: nothing to fetch, but the part's files must be what the manifest
        # says (a local folder cannot be repaired; remote files are fetched again).
        check_local_package(target.path, config.part)
        return target.path
    if not isinstance(target, RemotePackage):
        raise PackageError(f"{config.ref!r} is not a package (hf://, https:// or a folder)")
    with _bar("fetching", bytes_=True) as progress:
        if target.repo is None:
            return Materializer(config.cache_dir).fetch(target, config.part, progress=progress)
        # A hub repo of any kind: a package's files, or a GGUF/safetensors repo's ranges.
        source = open_ref(target, config.part, cache_dir=config.cache_dir, progress=progress)
    assert isinstance(source, PackageSource | RangedSource)  # open_ref's hub sources
    return source.folder


def run_validate(ref: str) -> list[str]:
    """Problems of a package folder (or of every file of a remote package, fetched first)."""
    target = resolve(ref)
    if isinstance(target, LocalSource):
        raise PackageError(f"{ref!r} is a model source, not a package: `package write` it first")
    if isinstance(target, RemotePackage):
        folder = Materializer().fetch(target, None)
    else:
        folder = target.path
    return [str(p) for p in validate_package(folder)]


@package_app.command("write")
def write_cmd(
    source: Annotated[
        str,
        typer.Argument(
            help="GGUF file, checkpoint folder, model alias, or hf://org/repo[@rev][:QUANT] "
            "(a GGUF or safetensors repo)"
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="package folder to write")],
    dtype: Annotated[str | None, typer.Option(help="convert weights: f16, bf16 or f32")] = None,
    speculative_default: Annotated[
        str | None, typer.Option(help="default speculative strategy name")
    ] = None,
    strategy: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME:type=ngram|draft-model,policy=fixed|adaptive,initial_window=N,"
            "min_window=N,max_window=N,key=value (repeatable)"
        ),
    ] = None,
    model_id: Annotated[str | None, typer.Option(help="model id in the manifest")] = None,
) -> None:
    """Split a model into a layer package."""
    if dtype not in (None, "f16", "bf16", "f32"):
        raise _fail([f"--dtype must be f16, bf16 or f32, not {dtype!r}"])
    config = WriteConfig(source, out, dtype, speculative_default, tuple(strategy or ()), model_id)  # type: ignore[arg-type]
    try:
        folder = run_write(config)
    except InvalidPackage as exc:
        raise _fail([str(p) for p in exc.problems]) from exc
    except (PackageError, SourceError, ValueError) as exc:
        raise _fail([str(exc)]) from exc
    print(folder)


@package_app.command("validate")
def validate_cmd(
    ref: Annotated[str, typer.Argument(help="package folder, hf://org/repo[@rev] or URL")],
) -> None:
    """Check a package; list every problem (file: field: message) and exit 2 if any."""
    try:
        problems = run_validate(ref)
    except (PackageError, SourceError) as exc:
        raise _fail([str(exc)]) from exc
    if problems:
        raise _fail(problems)
    print(f"ok: {ref}")


@package_app.command("fetch")
def fetch_cmd(
    ref: Annotated[str, typer.Argument(help="hf://org/repo[@rev], https:// URL or folder")],
    layers: Annotated[str, typer.Option(help="layer range START:END")],
    embed: Annotated[
        bool, typer.Option("--embed", help="also the embedding (first stage)")
    ] = False,
    head: Annotated[bool, typer.Option("--head", help="also the head (last stage)")] = False,
    cache_dir: Annotated[Path | None, typer.Option(help="cache folder")] = None,
) -> None:
    """Materialize one stage's files of a package and print the folder they are in."""
    try:
        part = Part.parse_range(layers, embed=embed, head=head)
        folder = run_fetch(FetchConfig(ref, part, cache_dir))
    except DamagedPackage as exc:
        raise _fail([*(str(p) for p in exc.problems), exc.advice]) from exc
    except InvalidPackage as exc:
        raise _fail([str(p) for p in exc.problems]) from exc
    except (PackageError, SourceError, ValueError) as exc:
        raise _fail([str(exc)]) from exc
    print(folder)
