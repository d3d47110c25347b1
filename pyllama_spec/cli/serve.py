"""`pyllama-spec serve`: the OpenAI-compatible HTTP server (pyllama_spec.server)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pyllama_spec.cli.options import (
    _load_engine_or_exit,
    _speculative_mode,
    err_console,
    model_options,
)


@click.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", default=8080, show_default=True)
@click.option("--api-key", envvar="LLAMA_API_KEY", default=None, help="require 'Authorization: Bearer KEY'")
@click.option("-a", "--alias", default=None, help="model name clients see (default: the file name)")
@click.option("-np", "--parallel", default=1, show_default=True, type=click.IntRange(1, 64),
              help="sequence slots: requests generated at once, every slot's draft verified in one target "
                   "batch; each slot gets ctx-size / np of the context")
@click.option("--queue", "max_queue", default=16, show_default=True,
              help="requests that may wait for a slot; more get 503")
@click.option("--allowed-image-dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="allow image_url parts that name local files under this folder")
@click.option("--max-images", default=8, show_default=True, help="images per request")
@click.option("--max-image-pixels", default=4096 * 4096, show_default=True, help="pixels per image")
@click.option("--max-body-mib", default=64, show_default=True, help="largest request body, MiB")
@click.option("-to", "--timeout", "body_timeout", default=60.0, show_default=True, type=click.FloatRange(min=0.1),
              help="seconds a request body may take to arrive (then 408); a request head must arrive "
                   "within 10 s")
def serve(host, port, api_key, alias, parallel, max_queue, allowed_image_dir, max_images, max_image_pixels,
          max_body_mib, body_timeout, **o):
    """OpenAI-compatible HTTP server (chat with images, speculative stats); needs the 'server' extra."""
    try:
        import uvicorn  # noqa: F401 - the server extra is there

        from pyllama_spec.server import ServerSettings, create_app
    except ImportError as e:
        err_console.print(f"[red]{e}[/red] (pip install 'pyllama-spec[server]')")
        sys.exit(2)
    engine = _load_engine_or_exit({**o, "n_parallel": parallel})
    settings = ServerSettings(alias=alias or Path(engine.model.path).stem, api_key=api_key, max_queue=max_queue,
                              default_max_tokens=o["max_tokens"], max_images=max_images,
                              max_image_pixels=max_image_pixels, max_body_bytes=max_body_mib * 2**20,
                              allowed_image_dir=Path(allowed_image_dir) if allowed_image_dir else None,
                              body_timeout=body_timeout)
    mode = _speculative_mode(engine)
    slots = f"{parallel} slots of {engine.ctx.n_ctx_seq} tokens" if parallel > 1 else "1 slot"
    err_console.print(f"[bold]pyllama-spec serve[/bold] · {engine.model.path.name} as '{settings.alias}' · "
                      f"speculative: {mode} · images: {'yes' if engine.projector else 'no'} · {slots} · "
                      f"http://{host}:{port}/v1")
    from pyllama_spec.server.run import serve as serve_app

    with engine:
        serve_app(create_app(engine, settings), host=host, port=port)
