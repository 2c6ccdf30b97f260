"""The GPT-2-like + AdamW state-dict builder now lives in :mod:`dcp_plus.bench.models`, shared
with ``dcp-plus bench``; this name stays for the benchmarks that import it."""

from dcp_plus.bench.models import (
    CONTEXT,
    LAYERS,
    MOMENT_DTYPE,
    PARAM_DTYPE,
    VOCAB,
    ModelShape,
    empty_like_state_dict,
    gpt2_like_state_dict,
    iter_tensors,
    map_tensors,
    shape_for_size,
    state_dict_nbytes,
    states_equal,
)

__all__ = ["CONTEXT", "LAYERS", "MOMENT_DTYPE", "PARAM_DTYPE", "VOCAB", "ModelShape",
           "empty_like_state_dict", "gpt2_like_state_dict", "iter_tensors",
           "map_tensors", "shape_for_size", "state_dict_nbytes", "states_equal"]
