"""``python -m dcp_plus``: the ``dcp-plus`` command."""

import sys

from dcp_plus.cli.main import main

sys.exit(main())
