"""SafeLoadPlanner: DCP's default load planner without ``torch.load(weights_only=False)``."""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from dcp_plus.errors import UnsafeCheckpointError
from dcp_plus.format.values import unsafe_reason


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``torch.load(weights_only=True)``; refuses the rest.

    Raises:
        UnsafeCheckpointError: naming the key whose value would need full unpickling.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise UnsafeCheckpointError(
                f"checkpoint value {fqn!r} does not load with torch.load(weights_only=True) "
                f"({unsafe_reason(e)}); refusing to unpickle it. Only load it with "
                "DefaultLoadPlanner if you trust the checkpoint's author"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
