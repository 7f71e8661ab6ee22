"""The click command class every podkit CLI uses: a usage error is one line naming the command
(`bin/preflight: no such option: --bogus (see bin/preflight --help)`), exit 2, like every other bad
input; click's default is a three-line block (usage, hint, error) that scripts cannot grep."""

from __future__ import annotations

import json
import signal
import sys

import click

from podkit.launch import wants_json  # stdlib only: the launcher reads it where click may be missing

EXIT_BAD_INPUT = 2


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a command as Ctrl-C does: SIGINT, SIGTERM, and SIGHUP (its terminal or SSH session
    closed: left to its default the command died and what it started ran on, unattended), unless SIGHUP came
    ignored (nohup, bin/pod run's detached jobs), which is kept. One rule for bin/smoke and bin/pod up."""
    hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGTERM, signal.SIGINT, *hup)


class OneLineMain:
    """click's main with usage errors as one line, exit 2; mixed into a Command or a Group."""

    def main(self, args=None, prog_name=None, **kwargs):
        kwargs.pop("standalone_mode", None)
        if prog_name and "complete_var" not in kwargs:
            # click derives the completion variable from prog_name; 'bin/preflight' would make an invalid
            # name, so spell it: eval "$(_PODKIT_PREFLIGHT_COMPLETE=bash_source bin/preflight)".
            kwargs["complete_var"] = f"_PODKIT_{prog_name.rsplit('/', 1)[-1].upper().replace('-', '_')}_COMPLETE"
        try:
            rv = super().main(args, prog_name, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            name = prog_name or self.name
            message = " ".join(exc.format_message().split())
            message = message[:1].lower() + message[1:]
            if wants_json(args):  # click stopped before the command could: scripts still get their object
                from podkit.checks.errors import ConfigError

                click.echo(json.dumps(ConfigError("", message, f"see {name} --help").to_json(), indent=2))
            click.echo(f"{name}: {message} (see {name} --help)", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.ClickException as exc:  # click.FileError and friends: one line too
            click.echo(f"{prog_name or self.name}: {' '.join(exc.format_message().split())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo(f"{prog_name or self.name}: interrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


class OneLineCommand(OneLineMain, click.Command):
    pass


MODEL_HELP = ("With --from or -- COMMAND: the model preset when neither a file nor the command names one podkit knows "
              "(refused when one does).")
"""--model's help, shared by bin/preflight and bin/smoke (both read --from through checks.importers)."""
