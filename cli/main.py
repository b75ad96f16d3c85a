"""The `moectl` command line (typer): one module per command group, registered here.

Exit codes: 0 success, 1 failure, 2 bad input. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from moectl.cli import bench, console, generate, record, serve, verify, web
from moectl.cli.engine_options import DEFAULT_OPTIONS
from moectl.cli.model import model_app
from moectl.cli.plan import plan_app
from moectl.cli.sim import sim_app
from moectl.cli.trace import trace_app

app = typer.Typer(name="moectl", no_args_is_help=False, invoke_without_command=True, add_completion=True,
                  pretty_exceptions_enable=False,
                  help="Control console for Mixture-of-Experts LLM inference: with no command, the live "
                       "Textual console on the embedded sample model; an embedded MoE engine, "
                       "its verification against transformers, benchmarks and the sample model.")
app.command()(generate.generate)
app.command()(verify.verify)
app.command()(bench.bench)
app.command()(console.run)
app.command()(console.replay)
app.command()(console.attach)
app.command("engine-host", hidden=True)(console.engine_host)
app.command()(serve.serve)
app.command()(record.record)
app.command()(web.web)
app.add_typer(model_app, name="model")
app.add_typer(plan_app, name="plan")
app.add_typer(trace_app, name="trace")
app.add_typer(sim_app, name="sim")


@app.callback()
def _default(ctx: typer.Context,
             theme: str | None = typer.Option(None, "--theme", help="With no command: the console's theme (dark, "
                                                                    "light, high-contrast).")) -> None:
    """With no command, `moectl` opens the live console (`moectl run` with its defaults)."""
    if ctx.invoked_subcommand is None:
        console.run(ctx=None, options=DEFAULT_OPTIONS, workload=console.DEMO_WORKLOAD, theme=theme or "dark",
                    engine=None, check_only=False)
    elif theme is not None:
        raise typer.BadParameter("--theme: give it after the command, e.g. `moectl replay T --theme light`")


def main() -> None:
    """Entry point: usage errors (unknown option, bad value) become one line and exit code 2."""
    try:  # newer typer vendors click
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
    except ImportError:
        from click.exceptions import NoArgsIsHelpError, UsageError

    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help())
        code = 0
    except UsageError as exc:
        where = f"{exc.ctx.command_path}: " if exc.ctx is not None else ""
        typer.echo(f"moectl: error: {where}{exc.format_message().splitlines()[0]}", err=True)
        code = 2
    except typer.Abort:
        typer.echo("moectl: error: aborted", err=True)
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
