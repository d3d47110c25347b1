"""`pyllama-spec rpc-server`: exec this build's ggml-rpc-server with the arguments as given."""

from __future__ import annotations

import sys

import click

from pyllama_spec.cli.options import err_console


@click.command("rpc-server", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                               "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def rpc_server(args) -> None:
    """Run ggml-rpc-server from this build: offer this machine's devices to another's --rpc.

    Its own flags: -H HOST (default 127.0.0.1), -p PORT (50052), -t THREADS, -d DEV1,DEV2, -c (cache
    weights on disk), -h. It has no authentication: bind it to a trusted network only."""
    import os

    from pyllama_spec.bindings import native_info

    path = native_info.RPC_SERVER_PATH
    if not path.exists():
        err_console.print(f"[red]this build has no ggml-rpc-server[/red] ({path} is missing): rebuild with "
                          "`python build.py --rpc`")
        sys.exit(2)
    os.execv(str(path), [str(path), *args])
