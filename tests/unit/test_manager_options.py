"""The manager's typed writer/reader options: the settings of the classes it builds, with their
defaults, refused at construction when bad; and a manager leaves the warning filters alone."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from dcp_plus.errors import InvalidOptionError
from dcp_plus.manager import (
    CheckpointManager,
    LocalReaderOptions,
    LocalWriterOptions,
    ObjectStoreReaderOptions,
    ObjectStoreWriterOptions,
)
from dcp_plus.readers import LocalReader, ObjectStoreReader
from dcp_plus.writers import LocalWriter, ObjectStoreWriter

PAIRS = [(LocalWriterOptions, LocalWriter), (ObjectStoreWriterOptions, ObjectStoreWriter),
         (LocalReaderOptions, LocalReader), (ObjectStoreReaderOptions, ObjectStoreReader)]


@pytest.mark.parametrize(("options", "cls"), PAIRS, ids=[c.__name__ for _, c in PAIRS])
def test_each_options_class_names_settings_of_its_class_with_its_defaults(options, cls):
    params = inspect.signature(cls.__init__).parameters
    for name, value in options().kwargs().items():
        assert name in params, f"{cls.__name__} takes no {name!r}"
        assert params[name].default == value, f"{options.__name__}.{name}"


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"workers": 0}, "LocalWriterOptions.workers"),
    ({"worker_nice": 20}, "LocalWriterOptions.worker_nice"),
    ({"threads": 2.5}, "LocalWriterOptions.threads"),
    ({"fsync": "yes"}, "LocalWriterOptions.fsync"),
    ({"codec": "zsdt"}, "LocalWriterOptions.codec"),
    ({"codecs": {"*.weight": "nope"}}, "LocalWriterOptions.codecs"),
])
def test_a_bad_setting_is_refused_when_built_naming_it(kwargs, named):
    with pytest.raises(InvalidOptionError, match=named.replace(".", r"\.")):
        LocalWriterOptions(**kwargs)


def test_settings_of_another_writer_or_a_dict_fail_the_construction_not_the_first_save(tmp_path):
    for bad in (ObjectStoreWriterOptions(), {"workers": 2}):
        with pytest.raises(InvalidOptionError, match="writer_options.*LocalWriterOptions"):
            CheckpointManager(tmp_path, writer_options=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="reader_options.*LocalReaderOptions"):
        CheckpointManager(tmp_path, reader_options=ObjectStoreReaderOptions())  # type: ignore
    with CheckpointManager(tmp_path, writer_options=LocalWriterOptions(threads=1, fsync=False),
                           reader_options=LocalReaderOptions(threads=1)) as m:  # lease free
        m.save(1, {"w": torch.arange(4.0)}).result(timeout=60)
        target = {"w": torch.zeros(4)}
        assert m.load_latest(target) == 1 and torch.equal(target["w"], torch.arange(4.0))


def test_a_manager_leaves_the_process_warning_filters_as_they_were(tmp_path):
    before = list(warnings.filters)
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.ones(3)}).result(timeout=60)
        m.load_latest({"w": torch.zeros(3)})
        assert warnings.filters == before
    assert warnings.filters == before
