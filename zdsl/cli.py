"""The `zdsl` command: a thin root that loads each subcommand from the module that owns it.

Subcommands live beside the code they drive (runtime, build, models, autotune, bench); this
file only names them, so `zdsl --help` stays fast and a new command is one line here.
Every ZdslError becomes one `error:` line and a non-zero exit.
"""

from __future__ import annotations

import importlib
import sys

import click

from zdsl.errors import ZdslError

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module:attribute, one-line help shown by `zdsl --help`)
    "devices": ("zdsl.runtime.commands:devices", "List Vulkan devices and compile-only targets."),
    "model": ("zdsl.models.qwen35.cli.commands:model", "Inspect GGUF models and make synthetic ones."),
    "build": ("zdsl.build:build_command", "Build every kernel variant; --target gfx1201 adds RDNA statistics."),
    "bench": ("zdsl.models.qwen35.cli.bench:bench", "Decode speed against the bandwidth roofline, across context lengths."),
    "bench-kernels": ("zdsl.bench_kernels:bench_kernels", "Time kernels: GPU time and GB/s against measured copy bandwidth."),
    "run": ("zdsl.models.qwen35.cli.run:run", "Generate text from a GGUF model (default: a synthetic one)."),
    "chat": ("zdsl.models.qwen35.cli.run:chat", "Chat interactively with a GGUF model."),
    "serve": ("zdsl.models.qwen35.serve.server:serve", "Serve a GGUF model over an OpenAI-compatible HTTP API."),
    "profile": ("zdsl.models.qwen35.cli.profile:profile", "Time one decode step dispatch by dispatch."),
    "eval": ("zdsl.models.qwen35.cli.quality:eval_group", "Measure quality: KV cache formats against f16 (eval kv)."),
    "tune": ("zdsl.models.qwen35.cli.tune:tune", "Pick the fastest kernel variants for a device (measured, or modelled for compile-only targets)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        target, _ = COMMANDS[name]
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="zdsl")
def cli():
    """zdsl: Vulkan kernels for LLM inference, written in a Python tile DSL."""


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "zdsl")


def run(command: click.Command, argv: list[str] | None, prog_name: str) -> int:
    """Run a click command the zdsl way: a ZdslError or usage error is one line on stderr and
    its exit code, never a traceback. (Also used by scripts/ that stand beside the CLI.)"""
    try:
        command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except ZdslError as e:
        click.echo(f"error: {e}", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
