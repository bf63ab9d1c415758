"""`covey tokenizer train`, `covey export` and `covey generate`. Heavy libraries are
imported inside the commands, so `covey --help` stays instant."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def _texts(paths: list[str], text_column: str) -> Iterator[str]:
    from covey.data.sources import user_documents

    for _, content in user_documents(paths, text_column):
        yield content.decode("utf-8", errors="replace") if isinstance(content, bytes) else content


def register(app: typer.Typer) -> None:
    """Add the commands to the main `covey` app."""
    tokenizer_app = typer.Typer(
        help="Tokenizers for your data.", no_args_is_help=True, rich_markup_mode=None
    )
    app.add_typer(tokenizer_app, name="tokenizer")

    @tokenizer_app.command("train")
    def tokenizer_train(
        vocab: Annotated[int, typer.Option(help="vocabulary size, incl. 256 bytes and EOS")],
        data: Annotated[list[str], typer.Option(help="text/JSONL/Parquet/... file or dir; repeat")],
        out: Annotated[Path, typer.Option(help="directory to write (transformers loads it)")],
        text_column: Annotated[str, typer.Option(help="column holding each row's text")] = "text",
    ) -> None:
        """Train a byte-level BPE tokenizer on your data (use it as --tokenizer hf:OUT)."""
        from covey.data.tokenizer import train_tokenizer

        try:
            tok = train_tokenizer(_texts(data, text_column), vocab, out)
        except (ValueError, FileNotFoundError) as e:
            raise _fail(str(e)) from None
        typer.echo(f"wrote {out}: {tok.vocab_size} tokens, eos id {tok.eos_id}")

    @app.command("export")
    def export(
        run_dir: Annotated[
            Path, typer.Argument(help="covey sim --out dir or coordinator data dir")
        ],
        out: Annotated[Path, typer.Option(help="Hugging Face directory to write")],
        round: Annotated[int | None, typer.Option(help="checkpoint round; default latest")] = None,
    ) -> None:
        """Export a run's checkpoint as a Hugging Face model directory."""
        from covey.io.export import export_run

        try:
            done = export_run(run_dir, out, round)
        except (ValueError, FileNotFoundError) as e:
            raise _fail(str(e)) from None
        typer.echo(f"exported round {done['round']} of {done['source']} to {out}")

    @app.command("generate")
    def generate(
        model: Annotated[Path, typer.Argument(help="exported directory or run directory")],
        prompt: Annotated[str, typer.Option(help="text to continue")] = "",
        max_new_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 40,
        temperature: Annotated[float, typer.Option(help="0 = greedy")] = 1.0,
        seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    ) -> None:
        """Print a sample from a model: the prompt and its continuation."""
        from covey.io.generate import generate as run_generate

        try:
            text = run_generate(
                model,
                prompt,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=seed,
            )
        except (ValueError, FileNotFoundError) as e:
            raise _fail(str(e)) from None
        typer.echo(prompt + text)
