"""`pyllama-spec generate`: one-shot generation, as text or one JSON object."""

from __future__ import annotations

import sys

import click

from pyllama_spec.cli.options import (
    ModelCommand,
    _load_engine,
    _sampling,
    err_console,
    footer,
    model_options,
)


@click.command(cls=ModelCommand)
@model_options
@click.option("-p", "--prompt", required=True,
              help="the prompt, sent as one user message through the model's chat template (--raw: as is)")
@click.option("--image", "images", multiple=True, type=click.Path(), help="image to attach (repeatable)")
@click.option("--raw", is_flag=True, help="send the prompt as is, without the chat template")
@click.option("--json", "as_json", is_flag=True, help="print text and stats as one JSON object")
def generate(prompt, images, raw, as_json, **o) -> None:
    """One-shot generation, scriptable."""
    import json

    from pyllama_spec.errors import PyllamaError

    try:
        with _load_engine(o) as engine:
            kwargs = dict(images=list(images), max_tokens=o["max_tokens"], **_sampling(o))
            if raw:
                stream = engine.stream(prompt, **kwargs)
            else:
                content = ([{"type": "image", "image": p} for p in images] + [{"type": "text", "text": prompt}]
                           if images else prompt)
                kwargs["images"] = []
                stream = engine.stream(messages=[{"role": "user", "content": content}], **kwargs)
            text, tokens, last = [], [], None
            for piece in stream:
                text.append(piece.text)
                tokens.extend(piece.tokens)
                last = piece
                if not as_json:
                    click.echo(piece.text, nl=False)
    except (PyllamaError, ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps({"text": "".join(text), "tokens": tokens, "finish_reason": last.finish_reason,
                               "stats": last.stats.as_dict()}))
    else:
        click.echo()
        err_console.print(f"[dim]{footer(last.stats)}[/dim]")
