"""`pyllama-spec serve`: the OpenAI- and llama-server-compatible HTTP server (pyllama_spec.server).

It takes llama-server's command lines: every llama-server flag is honoured or dropped with a
warning (cli/llama_server_cli.py), ``LLAMA_ARG_*`` variables set the honoured ones, and
``--models-preset FILE`` reads llama-server's preset files."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pyllama_spec.cli import llama_server_cli
from pyllama_spec.cli.options import (
    _load_engine_or_exit,
    _speculative_mode,
    err_console,
    model_options,
)


class LlamaServerCommand(click.Command):
    """A click command that reads llama-server's command lines (see llama_server_cli)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:  # llama-server's environment variables, for the options it shares
            if isinstance(param, click.Option) and param.envvar is None:
                flag = next((llama_server_cli.BY_NAME[n] for n in param.opts if n in llama_server_cli.BY_NAME), None)
                if flag is not None and flag.env:
                    param.envvar = flag.env

    def accepted(self, ctx: click.Context) -> dict[str, int]:
        """Every option name this command has (--help too), and how many values it takes."""
        out = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Option):
                n = 0 if (param.is_flag or param.count) else param.nargs
                for name in param.opts + param.secondary_opts:
                    out[name] = n
        return out

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        accepted = self.accepted(ctx)
        args, preset_warnings = _expand_preset([llama_server_cli.normalised(a) for a in args])
        args, warnings = llama_server_cli.translate(args, accepted)
        for w in [*preset_warnings, *warnings, *llama_server_cli.ignored_environment(accepted)]:
            err_console.print(f"[yellow]warning: {w}[/yellow]", soft_wrap=True)
        return super().parse_args(ctx, args)


def _expand_preset(args: list[str]) -> tuple[list[str], list[str]]:
    """--models-preset FILE (or LLAMA_ARG_MODELS_PRESET) replaced by the chosen section's
    arguments, placed first so that the command line overrides them; the section's name is the
    model name clients see unless -a gives one."""
    import os

    path, rest, i = os.environ.get("LLAMA_ARG_MODELS_PRESET"), [], 0
    while i < len(args):
        if args[i] == "--models-preset" and i + 1 < len(args):
            path, i = args[i + 1], i + 2
        elif args[i].startswith("--models-preset="):
            path, i = args[i].split("=", 1)[1], i + 1
        else:
            rest.append(args[i])
            i += 1
    if path is None:
        return args, []
    alias = next((rest[k + 1] for k in range(len(rest) - 1) if rest[k] in ("-a", "--alias")), None)
    try:
        preset = llama_server_cli.choose_preset(path, alias)
    except llama_server_cli.PresetError as e:
        raise click.UsageError(str(e)) from None
    named = [] if alias is not None or "--alias" in preset.args else ["--alias", preset.name]
    return [*preset.args, *named, *rest], preset.warnings


@click.command(cls=LlamaServerCommand)
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", default=8080, show_default=True)
@click.option("--api-key", envvar="LLAMA_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' (several keys: comma-separated)")
@click.option("--api-key-file", default=None, type=click.Path(dir_okay=False),
              help="a file of API keys, one per line")
@click.option("-a", "--alias", default=None, help="model name clients see (default: the file name)")
@click.option("-np", "--parallel", default=1, show_default=True, type=click.IntRange(-1, 64),
              help="sequence slots: requests generated at once, every slot's draft verified in one target "
                   "batch; each slot gets ctx-size / np of the context (-1: 1)")
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
def serve(host, port, api_key, api_key_file, alias, parallel, max_queue, allowed_image_dir, max_images,
          max_image_pixels, max_body_mib, body_timeout, **o):
    """OpenAI- and llama-server-compatible HTTP server (chat with images, speculative stats); takes
    llama-server's flags and --models-preset files. Needs the 'server' extra."""
    try:
        import uvicorn  # noqa: F401 - the server extra is there

        from pyllama_spec.server import ServerSettings, create_app
    except ImportError as e:
        err_console.print(f"[red]{e}[/red] (pip install 'pyllama-spec[server]')")
        sys.exit(2)
    if parallel == 0:
        raise click.BadParameter("must be -1 (auto) or at least 1", param_hint="'-np' / '--parallel'")
    parallel = max(parallel, 1)
    keys = _api_keys(api_key, api_key_file)
    engine = _load_engine_or_exit({**o, "n_parallel": parallel})
    settings = ServerSettings(alias=alias or Path(engine.model.path).stem, api_key=",".join(keys) or None,
                              max_queue=max_queue, default_max_tokens=_max_tokens(o["max_tokens"]),
                              max_images=max_images, max_image_pixels=max_image_pixels,
                              max_body_bytes=max_body_mib * 2**20,
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


def _max_tokens(n: int) -> int:
    """-n as the default max_tokens of a request: llama-server's -1 (no limit) is this server's cap."""
    from pyllama_spec.server import ServerSettings

    return ServerSettings.max_tokens if n < 0 else min(n, ServerSettings.max_tokens)


def _api_keys(given: str | None, path: str | None) -> list[str]:
    keys = [k.strip() for k in (given or "").split(",") if k.strip()]
    if path:
        try:
            keys += [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise click.BadParameter(f"cannot read {path}: {e}", param_hint="--api-key-file") from None
    return keys
