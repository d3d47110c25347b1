"""The `pyllama-spec` command (click + rich): doctor, build, and the commands built on the engine.

One module per command; options holds what several share (the model option table, the engine
loader, the consoles). Heavy imports stay inside the command functions: the CLI starts, and
doctor and build run, without the native build."""

from __future__ import annotations

import click

from pyllama_spec.cli import (
    bench,
    build,
    chat,
    demo,
    doctor,
    generate,
    rpc_server,
    serve,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pyllama-spec")
def main() -> None:
    """Vision-language models with DFlash speculative decoding on llama.cpp."""


for _command in (doctor.doctor, rpc_server.rpc_server, build.build, chat.chat, generate.generate, bench.bench,
                 demo.demo, serve.serve):
    main.add_command(_command)
del _command
