"""``meshnode generate``: one reply from a local model, streamed to stdout.

The command builds a :class:`GenerateConfig` from its flags and calls :func:`run`.
Bad input (unknown model, missing file, unsupported model, unavailable device) is
reported as one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Annotated, TextIO, cast

import typer

from meshnode.cli import app
from meshnode.engine.backend import BackendError, Device, limit_cpu_threads, select_backend
from meshnode.engine.loader import LoadedModel, ModelLoadError, load_model
from meshnode.engine.sampling import GREEDY, SamplingParams
from meshnode.engine.tokenizer import TemplateError
from meshnode.errors import ConfigError
from meshnode.node.settings import DTYPE_HELP, KV_DTYPE_HELP
from meshnode.serve.local import GenerationResult, generate_local

__all__ = ["EXIT_BAD_INPUT", "GenerateConfig", "run"]

EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class GenerateConfig:
    """Everything one ``meshnode generate`` run needs: a text ``prompt`` or ``prompt_ids``."""

    prompt: str | None = None
    model: str | None = None
    max_tokens: int = 256
    sampling: SamplingParams = GREEDY
    raw: bool = False
    json: bool = False
    device: Device = "auto"
    dtype: str = "auto"  # weights (auto: q8 on the CPU); select_backend checks it
    kv_dtype: str = "auto"  # a CPU stage's KV caches (engine.kv_cache.KV_DTYPES)
    threads: int | None = None
    prompt_ids: tuple[int, ...] | None = None  # token ids in, as given (no template, no BOS)


def prompt_ids(model: LoadedModel, prompt: str, raw: bool) -> list[int]:
    """Token ids for ``prompt``: chat-templated as one user turn unless ``raw``."""
    if raw or model.chat_template is None:
        return model.tokenizer.encode_prompt(prompt)
    text = model.chat_template.render([{"role": "user", "content": prompt}])
    return model.tokenizer.encode_prompt(text)


def parse_prompt_ids(text: str) -> tuple[int, ...]:
    """``"1,2,3"`` -> ``(1, 2, 3)``; raises ``ValueError`` naming the bad entry."""
    ids = []
    for part in text.split(","):
        try:
            ids.append(int(part.strip()))
        except ValueError:
            raise ValueError(f"--prompt-ids: {part.strip()!r} is not a token id") from None
    return tuple(ids)


def _config_ids(model: LoadedModel, config: GenerateConfig) -> list[int]:
    if config.prompt_ids is None:
        assert config.prompt is not None
        return prompt_ids(model, config.prompt, config.raw)
    vocab = model.config.vocab_size
    bad = [t for t in config.prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return list(config.prompt_ids)


def complete(model: LoadedModel, config: GenerateConfig, out: TextIO | None) -> GenerationResult:
    """Generate the reply through the API's generation loop, over a local pipeline
    (:func:`meshnode.serve.local.generate_local`), streaming text to ``out`` when given."""
    ids = _config_ids(model, config)

    def write(text: str) -> None:
        if out is not None:
            out.write(text)
            out.flush()

    return generate_local(
        model.stage,
        model.tokenizer,
        ids,
        config.sampling,
        max_tokens=config.max_tokens,
        eos_ids=model.config.eos_token_ids,
        on_text=write,
    )


def run(config: GenerateConfig) -> int:
    """Run one generation; return the process exit status."""
    try:
        limit = limit_cpu_threads(config.threads)  # held until generation ends
        backend = select_backend(config.device, config.dtype)
        model = load_model(config.model, backend, config.kv_dtype)
        result = complete(model, config, sys.stdout)
    except (BackendError, ConfigError, ModelLoadError, TemplateError, ValueError) as exc:
        print(f"meshnode generate: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    del limit
    sys.stdout.write("\n")
    if config.json:
        sys.stdout.write(json.dumps(result.as_dict()) + "\n")
    return 0


@app.command("generate")
def generate_command(
    prompt: Annotated[
        str | None, typer.Argument(help="The user message (or raw text with --raw).")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="Model alias (smollm2-135m), GGUF file or checkpoint folder."),
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="0 keeps every token.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible sampling.")] = None,
    raw: Annotated[bool, typer.Option(help="Feed PROMPT as is, without chat template.")] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print a JSON summary as the last line.")
    ] = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    dtype: Annotated[
        str,
        typer.Option(help=DTYPE_HELP),
    ] = "auto",
    kv_dtype: Annotated[
        str,
        typer.Option(help=KV_DTYPE_HELP),
    ] = "auto",
    threads: Annotated[
        int | None, typer.Option(min=1, help="BLAS threads on CPU (default: one per core).")
    ] = None,
    prompt_ids: Annotated[
        str | None,
        typer.Option(
            "--prompt-ids",
            help="Token ids (1,2,3) instead of PROMPT, fed as given; --json reports ids.",
        ),
    ] = None,
) -> None:
    """Generate a reply from a local model and stream it to stdout."""
    if device not in ("auto", "cpu", "cuda"):
        typer.echo(f"meshnode generate: error: unknown device {device!r}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    if (prompt is None) == (prompt_ids is None):
        typer.echo("meshnode generate: error: give PROMPT or --prompt-ids (one)", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        ids = None if prompt_ids is None else parse_prompt_ids(prompt_ids)
    except ValueError as exc:
        typer.echo(f"meshnode generate: error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    config = GenerateConfig(
        prompt=prompt,
        model=model,
        max_tokens=max_tokens,
        sampling=sampling,
        raw=raw,
        json=json_output,
        device=cast(Device, device),  # checked above
        dtype=dtype,
        kv_dtype=kv_dtype,
        threads=threads,
        prompt_ids=ids,
    )
    raise typer.Exit(run(config))
