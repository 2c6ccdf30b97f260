"""``dcp-plus convert SRC DST``: a checkpoint from one format to another, through each side's
own reader and writer (no format encoder of its own). Importing this package does not import
torch: the verb's modules load when it runs."""

from dcp_plus.cli.convert.cli import add_convert_arguments, cmd_convert

__all__ = ["add_convert_arguments", "cmd_convert"]
