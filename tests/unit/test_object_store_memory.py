"""ObjectStoreWriter/ObjectStoreReader on fsspec's in-memory filesystem (and file://)."""

from __future__ import annotations

import pickle
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import (
    CheckpointNotFoundError,
    InvalidOptionError,
    ObjectStoreReader,
    ObjectStoreWriter,
    SafeLoadPlanner,
    StorageError,
)
from dcp_plus.format.codecs import ZstdCodec, get_codec
from dcp_plus.storage.http_errors import HTTP_ERRORS, is_retryable
from dcp_plus.storage.objectio import open_store
from dcp_plus.storage.ranged import ExtentFill, StoreConfig, assemble, part_bounds, plan_requests
from dcp_plus.storage.retry import Retry, RetryPolicy
from tools.testkit.exact import assert_bit_exact

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
KiB, MiB = 1 << 10, 1 << 20


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(300, 1000, generator=g),
        "half": torch.randn(77, 5, generator=g).half(),
        "i8": torch.randint(-128, 127, (1001,), dtype=torch.int8, generator=g),
        "t": torch.randn(40, 30, generator=g).t(),
        "empty": torch.empty(0),
        "step": 5,
        "cfg": {"name": "x", "betas": [0.9, 0.99]},
    }


def blank(sd: dict[str, Any]) -> dict[str, Any]:
    """A load target for ``sd``, in its key order: zeroed tensors, blank values."""
    placeholders = {"step": 0, "cfg": {"name": "", "betas": [0.0, 0.0]}}
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else placeholders[k]
            for k, v in sd.items()}


@pytest.fixture
def url() -> str:
    return f"memory://dcpp-tests/{uuid.uuid4().hex[:12]}"


def objects(url: str) -> dict[str, int]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p.rsplit("/", 1)[1]: fs.size(p) for p in fs.ls(root, detail=False)}


def test_round_trip_is_bit_exact(url: str) -> None:
    sd = state()
    dcp.save(sd, storage_writer=ObjectStoreWriter(url, part_size=256 * KiB))
    out = blank(sd)
    dcp.load(out, storage_reader=ObjectStoreReader(url, range_size=64 * KiB,
                                                   coalesce_gap=4 * KiB),
             planner=SafeLoadPlanner())
    assert_bit_exact(out, sd)
    names = set(objects(url))
    assert ".metadata" in names and all(
        n.startswith("__0_") and n.endswith(".dcpp") for n in names - {".metadata"})


def test_round_trip_through_file_url(tmp_path: Any) -> None:
    sd = state()
    url = f"file://{tmp_path}/ckpt"
    dcp.save(sd, storage_writer=ObjectStoreWriter(url))
    out = blank(sd)
    dcp.load(out, storage_reader=ObjectStoreReader(url), planner=SafeLoadPlanner())
    assert_bit_exact(out, sd)


def test_flipped_byte_is_reported_with_tensor_name(url: str) -> None:
    # one object: the larger tensor first at offset 0, the smaller at the next 4 KiB boundary
    sd = {"small": torch.ones(1024), "large": torch.arange(8192, dtype=torch.float32)}
    dcp.save(sd, storage_writer=ObjectStoreWriter(url))
    fs, root = fsspec.core.url_to_fs(url)
    (name,) = [n for n in objects(url) if n.endswith(".dcpp")]
    data = bytearray(fs.cat_file(f"{root}/{name}"))
    data[8192 * 4 + 100] ^= 0x01
    fs.pipe_file(f"{root}/{name}", bytes(data))
    with pytest.raises(BaseException, match="checksum mismatch in tensor 'small'") as e:
        dcp.load(blank(sd), storage_reader=ObjectStoreReader(url))
    assert f"{url}/{name}" in str(e.value)
    # verify=False loads the damaged bytes without complaint
    out = blank(sd)
    dcp.load(out, storage_reader=ObjectStoreReader(url, verify=False))
    assert torch.equal(out["large"], sd["large"]) and not torch.equal(out["small"], sd["small"])


def test_truncated_object_is_reported_before_reading(url: str) -> None:
    sd = {"w": torch.ones(10_000)}
    dcp.save(sd, storage_writer=ObjectStoreWriter(url))
    fs, root = fsspec.core.url_to_fs(url)
    (name,) = [n for n in objects(url) if n.endswith(".dcpp")]
    fs.pipe_file(f"{root}/{name}", fs.cat_file(f"{root}/{name}")[:100])
    with pytest.raises(BaseException, match=r"tensor 'w'.*runs past the end"):
        dcp.load(blank(sd), storage_reader=ObjectStoreReader(url))


class _Unsafe:
    pass


def test_failed_save_leaves_no_commit_record(url: str) -> None:
    with pytest.raises(BaseException, match="weights_only"):
        dcp.save({"w": torch.ones(3), "bad": _Unsafe()}, storage_writer=ObjectStoreWriter(url))
    fs, root = fsspec.core.url_to_fs(url)
    assert not fs.exists(f"{root}/.metadata")
    with pytest.raises(BaseException, match="no commit record"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=ObjectStoreReader(url))


def test_missing_checkpoint_raises_not_found(url: str) -> None:
    reader = ObjectStoreReader(url)
    with pytest.raises(CheckpointNotFoundError, match=url):
        reader.read_metadata()


def test_overwrite_is_refused_then_replaces_and_cleans_up(url: str) -> None:
    dcp.save({"w": torch.full((100,), 1.0)}, storage_writer=ObjectStoreWriter(url))
    old = set(objects(url))
    with pytest.raises(BaseException, match="already holds a committed checkpoint"):
        dcp.save({"w": torch.full((100,), 2.0)}, storage_writer=ObjectStoreWriter(url))
    assert set(objects(url)) == old
    dcp.save({"w": torch.full((100,), 2.0)}, storage_writer=ObjectStoreWriter(url,
                                                                            overwrite=True))
    out = {"w": torch.zeros(100)}
    dcp.load(out, storage_reader=ObjectStoreReader(url))
    assert torch.equal(out["w"], torch.full((100,), 2.0))
    assert old & set(objects(url)) == {".metadata"}


def test_writer_and_reader_pickle_for_process_mode(url: str) -> None:
    w = ObjectStoreWriter(url, {"skip_instance_cache": False})
    w.set_up_storage_writer(True, rank=0)  # opens the store
    w2 = pickle.loads(pickle.dumps(w))
    assert w2.url == url and w2.storage_options == {"skip_instance_cache": False}
    r = pickle.loads(pickle.dumps(ObjectStoreReader(url)))
    assert r.checkpoint_id == url


def test_validate_checkpoint_id_takes_urls_only() -> None:
    assert ObjectStoreWriter.validate_checkpoint_id("s3://b/p")
    assert ObjectStoreReader.validate_checkpoint_id("memory://x")
    assert not ObjectStoreWriter.validate_checkpoint_id("/local/dir")
    for nowhere in ("s3://", "s3:///", "s3:///key", "gs://", "memory://", "memory:///"):
        assert not ObjectStoreWriter.validate_checkpoint_id(nowhere), nowhere
        assert not ObjectStoreReader.validate_checkpoint_id(nowhere), nowhere
    assert ObjectStoreReader.validate_checkpoint_id("s3://bucket")
    assert ObjectStoreReader.validate_checkpoint_id("file:///tmp/ckpt")
    with pytest.raises(InvalidOptionError, match="names no bucket"):
        ObjectStoreWriter("s3:///key")


def test_plan_requests_coalesce_close_extents_and_cut_at_range_multiples() -> None:
    extents = [("o", 100, 20), ("o", 0, 10), ("o", 1000, 30), ("p", 5, 3), ("o", 50, 0)]
    reqs = plan_requests(extents, gap=100, max_len=16)
    # o: 0..10 and 100..120 coalesce (gap 90 <= 100) into 0..120; 1000..1030 alone; both cut
    # at the multiples of 16, so that no request straddles an uploaded part's boundary;
    # then p; the empty extent gets no request
    assert [(r.name, r.start) for r in reqs] == [
        ("o", s) for s in (0, 16, 32, 48, 64, 80, 96, 112, 1000, 1008, 1024)] + [("p", 5)]
    for r in reqs:
        assert r.length <= 16 and r.start // 16 == (r.start + r.length - 1) // 16
    assert reqs[0].pieces == [(1, 0, 10), (-1, 0, 6)]
    assert reqs[6].pieces == [(-1, 86, 90), (0, 0, 12)]  # bytes 96..112
    assert [p for r in reqs if r.name == "o" and r.start >= 1000 for p in r.pieces] == [
        (2, 0, 8), (2, 8, 24), (2, 24, 30)]
    # every extent byte is covered exactly once, in order
    for k, (name, _, length) in enumerate(extents):
        got = [(lo, hi) for r in reqs if r.name == name for kk, lo, hi in r.pieces if kk == k]
        assert sum(hi - lo for lo, hi in got) == length
        assert all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))


def test_extent_fill_opens_lazily_and_reports_each_extent_once() -> None:
    extents = [("o", 0, 40), ("o", 40, 8), ("o", 64, 4)]
    reqs = plan_requests(extents, gap=100, max_len=32)  # 0..32, 32..64, 64..68
    opened: list[int] = []
    bufs = {k: memoryview(bytearray(n)) for k, (_, _, n) in enumerate(extents)}

    def open_extent(k: int) -> memoryview:
        opened.append(k)
        return bufs[k]
    book = ExtentFill(reqs, open_extent)
    views = [book.views(r) for r in reqs[:1]]
    assert opened == [0] and [len(v) for v in views[0]] == [32]
    views.append(book.views(reqs[1]))
    assert opened == [0, 1] and [len(v) for v in views[1]] == [8, 8, 16]  # 16 = gap
    assert book.finished(reqs[0]) == []
    assert book.finished(reqs[1]) == [0, 1]
    book.views(reqs[2])
    assert book.finished(reqs[2]) == [2]


def test_assemble_and_part_bounds_rebuild_the_object_image() -> None:
    segs = [(0, memoryview(b"abc")), (8, memoryview(b"defgh"))]
    starts = [0, 8]
    image = b"".join(assemble(segs, starts, a, b) for a, b in part_bounds(13, 4))
    assert image == b"abc\0\0\0\0\0defgh"
    # a part size too small for S3's 10,000-part limit is grown; parts tile the object
    parts = part_bounds(10 * MiB, 1)
    assert len(parts) <= 10_000 and parts[0][0] == 0 and parts[-1][1] == 10 * MiB
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))


def test_retry_recovers_from_transient_errors_within_the_bound() -> None:
    failures = [ConnectionResetError("reset by peer"), TimeoutError("slow")]

    def flaky(attempt: int) -> str:
        if failures:
            raise failures.pop(0)
        return f"ok after {attempt}"

    assert Retry(RetryPolicy(2, 0.001, 0.001), HTTP_ERRORS).call(flaky, "GET x") == "ok after 2"


def test_retry_gives_up_after_max_retries_naming_the_request() -> None:
    calls = []

    def down(attempt: int) -> None:
        calls.append(attempt)
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(StorageError, match=r"GET s3://b/k failed after 4 attempt\(s\)"):
        Retry(RetryPolicy(3, 0.001, 0.001), HTTP_ERRORS).call(down, "GET s3://b/k")
    assert calls == [0, 1, 2, 3]


def test_non_request_errors_are_not_retried() -> None:
    calls = []

    def missing(attempt: int) -> None:
        calls.append(attempt)
        raise FileNotFoundError("no such object")

    with pytest.raises(FileNotFoundError):
        Retry(RetryPolicy(3, 0.001, 0.001), HTTP_ERRORS).call(missing, "GET x")
    assert calls == [0]
    assert not is_retryable(PermissionError("denied"))


def test_backoff_is_jittered_and_capped() -> None:
    p = RetryPolicy(10, base_delay=0.5, max_delay=2.0)
    delays = [p.delay(a) for a in range(10) for _ in range(20)]
    assert all(0 <= d <= 2.0 for d in delays)
    assert len({round(d, 6) for d in delays}) > 100


def test_zstd_codecs_round_trip_per_pattern_and_store_less(url: str) -> None:
    sd = state()
    sd["zeros"] = torch.zeros(200_000)  # very compressible
    w = ObjectStoreWriter(url, codec="zstd",
                          codecs={"half": "zstd+shuffle", "i8": "identity",
                                  "z*": ZstdCodec(level=1, threads=2, frame_size=64 * KiB)})
    dcp.save(sd, storage_writer=w)
    md = ObjectStoreReader(url).read_metadata()
    by_fqn = {i.fqn: e for i, e in md.storage_data.items()}
    assert by_fqn["a"].codec == "zstd" and by_fqn["half"].codec == "zstd+shuffle"
    assert by_fqn["i8"].codec == "identity" and by_fqn["zeros"].codec == "zstd"
    assert by_fqn["step"].codec == "identity"  # non-tensor values are never encoded
    assert by_fqn["zeros"].length < by_fqn["zeros"].raw_length // 100
    out = blank(sd)
    dcp.load(out, storage_reader=ObjectStoreReader(url), planner=SafeLoadPlanner())
    assert_bit_exact(out, sd)


def test_flipped_byte_in_compressed_extent_is_reported_before_decoding(url: str) -> None:
    sd = {"w": torch.randn(50_000)}
    dcp.save(sd, storage_writer=ObjectStoreWriter(url, codec="zstd+shuffle"))
    fs, root = fsspec.core.url_to_fs(url)
    (name,) = [n for n in objects(url) if n.endswith(".dcpp")]
    data = bytearray(fs.cat_file(f"{root}/{name}"))
    data[len(data) // 2] ^= 0x40
    fs.pipe_file(f"{root}/{name}", bytes(data))
    with pytest.raises(BaseException, match="checksum mismatch in tensor 'w'"):
        dcp.load({"w": torch.zeros(50_000)}, storage_reader=ObjectStoreReader(url))


@pytest.mark.parametrize("shuffle", [False, True])
def test_zstd_frames_decode_independently_and_reject_bad_input(shuffle: bool) -> None:
    codec = ZstdCodec(level=3, threads=2, shuffle=shuffle, frame_size=1024)
    t = torch.randn(10_001).to(torch.bfloat16)  # 20,002 bytes: 20 frames, the last short
    raw = memoryview(t.view(torch.int16).numpy()).cast("B")
    stored = memoryview(codec.encode(raw, itemsize=2))
    out = bytearray(len(raw))
    get_codec(codec.name).decode_into(stored, memoryview(out))  # any instance decodes
    assert bytes(out) == bytes(raw)
    with pytest.raises(ValueError, match="frames"):
        codec.decode_into(stored, memoryview(bytearray(len(raw) + 4096)))
    with pytest.raises(ValueError, match="bad header"):
        codec.decode_into(memoryview(b"XXXX" + bytes(stored[4:])), memoryview(out))


@pytest.mark.parametrize("codec", ["identity", "zstd", "zstd+shuffle"])
def test_every_dtype_and_layout_round_trips_bit_exact(url: str, codec: str) -> None:
    from tests.conftest import build_state_dict, load_target

    sd = build_state_dict(seed=11)
    dcp.save(sd, storage_writer=ObjectStoreWriter(url, codec=codec), no_dist=True)
    out = load_target(sd)
    dcp.load(out, storage_reader=ObjectStoreReader(url), planner=SafeLoadPlanner(),
             no_dist=True)
    assert_bit_exact(out, sd)
    md = ObjectStoreReader(url).read_metadata()
    assert md.storage_meta is not None and md.storage_meta.checkpoint_id == url
    assert all(n.split(".")[1] == md.storage_meta.save_id
               for n in objects(url) if n.endswith(".dcpp"))


def test_single_process_without_collectives_is_refused(url: str) -> None:
    with pytest.raises(BaseException, match="needs use_collectives=True"):
        ObjectStoreWriter(url).set_up_storage_writer(True, rank=0, use_collectives=False)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as p:
        yield p


def _extent_store(url: str, **config: Any) -> Any:
    return open_store(url, None, StoreConfig(**config))


def test_read_extents_bounds_open_buffers_and_delivers_each_extent_once(
        url: str, pool: ThreadPoolExecutor) -> None:
    store = _extent_store(url, concurrency=2, range_size=20, coalesce_gap=0)
    data = bytes(range(200)) * 5  # 1000 bytes
    store.put("obj", data, if_absent=False)
    extents = [("obj", 10 * k, 10) for k in range(100)] + [("obj", 0, 0)]
    bufs: dict[int, bytearray] = {}
    lock = threading.Lock()
    live: set[int] = set()
    peak, done_calls = [0], []

    def open_extent(k: int) -> memoryview:
        with lock:
            bufs[k] = bytearray(10)
            live.add(k)
            peak[0] = max(peak[0], len(live))
        return memoryview(bufs[k])

    def done(k: int) -> None:
        with lock:
            live.discard(k)
            done_calls.append(k)
    store.read_extents(extents, open_extent, done, pool)
    assert sorted(done_calls) == list(range(100))  # each once; the empty one not at all
    assert all(bytes(bufs[k]) == data[10 * k : 10 * k + 10] for k in range(100))
    # buffers exist only for the requests in flight or being delivered (2 x 2 extents),
    # and for the one being opened
    assert peak[0] <= 6


def test_read_extents_raises_the_first_failure_and_stops(
        url: str, pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _extent_store(url, concurrency=2, range_size=10, coalesce_gap=0)
    store.put("obj", bytes(1000), if_absent=False)
    is_retryable(PermissionError())  # its first call imports the HTTP stacks: slow
    calls = []
    real = store.fs.cat_file

    def cat_file(path: str, start: int, end: int) -> bytes:
        calls.append(start)
        if start == 30:
            raise PermissionError("denied")  # not retryable
        return real(path, start, end)
    monkeypatch.setattr(store.fs, "cat_file", cat_file)  # fsspec shares the instance
    with pytest.raises(PermissionError, match="denied"):
        store.read_extents([("obj", 10 * k, 10) for k in range(100)],
                           lambda k: memoryview(bytearray(10)), lambda k: None, pool)
    assert len(calls) < 10  # the remaining requests were not sent
    # an object that ends before an extent does
    with pytest.raises(EOFError, match="ends"):
        store.read_extents([("obj", 990, 20)], lambda k: memoryview(bytearray(20)),
                           lambda k: None, pool)
