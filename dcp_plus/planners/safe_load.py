"""SafeLoadPlanner: DCP's default load planner without ``torch.load(weights_only=False)``."""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from dcp_plus._compat.torch_dcp import set_element
from dcp_plus.errors import UnsafeCheckpointError
from dcp_plus.format.values import RawBytesIO, unsafe_reason
from dcp_plus.planners.whole_reads import whole_reads


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``torch.load(weights_only=True)``; refuses the rest.

    ``io.BytesIO`` values come back as ``io.BytesIO`` objects with the saved contents: raw
    from dcp_plus checkpoints, and from stock DCP ones (which pickle them) by an unpickler
    that allows that one class besides what ``weights_only`` allows.

    Raises:
        UnsafeCheckpointError: naming the key whose value would need full unpickling.
    """

    loads_raw_bytesio = True

    def create_local_plan(self) -> LoadPlan:
        """DCP's default local plan; built directly (no resharding sweep) when every
        tensor is read whole from one stored chunk of its own shape."""
        if self.metadata is not None:
            items = whole_reads(self.state_dict, self.metadata, not self.allow_partial_load)
            if items is not None:
                return LoadPlan(items)
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            if isinstance(value, RawBytesIO):
                obj: object = io.BytesIO(value.getvalue())
            else:
                with torch.serialization.safe_globals([io.BytesIO]):
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
