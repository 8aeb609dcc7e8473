"""The --help layout of the commands users run: each flag's names, then its value's name once
(`-tp, --tp, --tensor-parallel-size N`, not the value after every name), a switch as `--[no-]flag`, and the
description's line breaks kept (its examples)."""
import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str, **kwargs):
        super().__init__(prog, max_help_position=30, **kwargs)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        if isinstance(action, argparse.BooleanOptionalAction):
            names = [s for s in action.option_strings if not s.startswith("--no-")]
            return ", ".join(f"--[no-]{s[2:]}" if s.startswith("--") else s for s in names)
        if action.nargs == 0:
            return ", ".join(action.option_strings)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {value}"

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return "N" if action.type is int else action.dest.upper()
