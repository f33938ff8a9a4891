"""The argparse help formatter of the project's commands (drafter-demo, drafter-serve, the benchmarks)."""
import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help only when the help does not say its default already and the
    default is a value (not None, not a bare switch's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)
