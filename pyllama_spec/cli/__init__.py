"""The `pyllama-spec` command (click + rich): doctor, build, and the commands built on the engine.

One module per command; options holds what several share (the model option table, the engine
loader, the consoles). Heavy imports stay inside the command functions: the CLI starts, and
doctor and build run, without the native build."""

from __future__ import annotations

import importlib

import click

#: Each command's module and function, imported when the command runs (or --help lists it): `serve`
#: starts without importing the benchmark, the demo or the chat.
COMMANDS = {
    "doctor": "doctor", "rpc-server": "rpc_server", "build": "build", "chat": "chat", "generate": "generate",
    "bench": "bench", "demo": "demo", "serve": "serve",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx, name: str):
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"pyllama_spec.cli.{COMMANDS[name]}")
        return getattr(module, COMMANDS[name])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pyllama-spec")
def main() -> None:
    """Vision-language models with DFlash speculative decoding on llama.cpp."""
