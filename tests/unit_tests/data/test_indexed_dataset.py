"""MMIDIDX reader and builder: round trips, byte layout against an independent parse, bad files."""

import os
import pickle
import struct

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

# The code table written out from the format description, not from the module under test.
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def _documents(rng, dtype, n_docs=5):
    """Documents as lists of sequences (arrays), some sequences empty."""
    docs = []
    for _ in range(n_docs):
        seqs = []
        for _ in range(int(rng.integers(1, 4))):
            length = int(rng.integers(0, 9))
            seqs.append((rng.integers(0, 100, size=length)).astype(dtype))
        docs.append(seqs)
    return docs


def _build(prefix, docs, dtype, multimodal=False):
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype, multimodal=multimodal)
    for d, seqs in enumerate(docs):
        for s, seq in enumerate(seqs):
            builder.add_item(seq, mode=(d + s) % 3) if multimodal else builder.add_item(seq)
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


def _parse_idx(path, multimodal=False):
    """Independent reading of megatron-compat.md §2 with struct and numpy."""
    raw = open(path, "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    code = raw[17]
    n, d = struct.unpack_from("<QQ", raw, 18)
    lengths = np.frombuffer(raw, "<i4", n, 34)
    pointers = np.frombuffer(raw, "<i8", n, 34 + 4 * n)
    docs = np.frombuffer(raw, "<i8", d, 34 + 12 * n)
    end = 34 + 12 * n + 8 * d
    modes = np.frombuffer(raw, "i1", n, end) if multimodal else None
    assert len(raw) == end + (n if multimodal else 0)
    return dict(version=version, code=code, n=n, d=d, lengths=lengths, pointers=pointers, docs=docs, modes=modes)


@pytest.mark.parametrize("code", sorted(CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = CODES[code]
    docs = _documents(np.random.default_rng(code), dtype)
    prefix = str(tmp_path / "ds")
    _build(prefix, docs, dtype)
    seqs = [s for doc in docs for s in doc]
    for mmap in (True, False):
        ds = IndexedDataset(prefix, mmap=mmap)
        assert len(ds) == len(seqs)
        assert ds.dtype == dtype
        for i, seq in enumerate(seqs):
            assert ds[i].dtype == dtype
            np.testing.assert_array_equal(ds[i], seq)
        for got, want in zip(ds[1:4], seqs[1:4]):
            np.testing.assert_array_equal(got, want)
    assert _parse_idx(get_idx_path(prefix))["code"] == code


def test_file_bytes_match_independent_parse(tmp_path):
    docs = [[np.array([5, 6, 7]), np.array([8])], [np.array([], dtype=np.int64)], [np.array([1, 2]), np.array([3])]]
    prefix = str(tmp_path / "ds")
    _build(prefix, docs, np.uint16)
    p = _parse_idx(get_idx_path(prefix))
    want_lengths = [3, 1, 0, 2, 1]
    assert p["version"] == 1 and p["code"] == 8 and p["n"] == 5 and p["d"] == 4
    assert p["lengths"].tolist() == want_lengths
    assert p["pointers"].tolist() == [0, 6, 8, 8, 12]  # running sum of length * 2 bytes
    assert p["docs"].tolist() == [0, 2, 3, 5]
    bin_bytes = open(get_bin_path(prefix), "rb").read()
    assert bin_bytes == np.array([5, 6, 7, 8, 1, 2, 3], "<u2").tobytes()


def test_multimodal_modes_and_add_document(tmp_path):
    prefix = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32, multimodal=True)
    builder.add_item(np.array([1, 2]), mode=3)
    builder.end_document()
    builder.add_document(np.arange(5), [2, 3], modes=[1, -1])
    builder.finalize(get_idx_path(prefix))
    p = _parse_idx(get_idx_path(prefix), multimodal=True)
    assert p["modes"].tolist() == [3, 1, -1]
    assert p["docs"].tolist() == [0, 1, 3]
    ds = IndexedDataset(prefix, multimodal=True)
    tokens, mode = ds[2]
    assert tokens.tolist() == [2, 3, 4] and mode == -1
    assert ds.sequence_modes.tolist() == [3, 1, -1]
    with pytest.raises(ValueError, match="multimodal=True"):
        IndexedDataset(prefix)


def test_get_pickle_exists_and_torch_input(tmp_path):
    torch = pytest.importorskip("torch")
    prefix = str(tmp_path / "ds")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int64)
    builder.add_item(torch.arange(10))
    builder.end_document()
    builder.add_documents(np.arange(6), [2, 4], [2])  # one document of two sequences
    builder.finalize(get_idx_path(prefix))
    assert IndexedDataset.exists(prefix) and not IndexedDataset.exists(prefix + "x")
    for mmap in (True, False):
        ds = pickle.loads(pickle.dumps(IndexedDataset(prefix, mmap=mmap)))
        assert ds.get(0, offset=3, length=4).tolist() == [3, 4, 5, 6]
        assert ds.get(2, offset=1).tolist() == [3, 4, 5]
        assert ds.document_indices.tolist() == [0, 1, 3]
        assert ds[-1].tolist() == [2, 3, 4, 5]
        with pytest.raises(IndexError):
            ds.get(1, offset=1, length=2)
        with pytest.raises(IndexError):
            ds[3]


def test_add_index_merges_and_checks_dtype(tmp_path):
    rng = np.random.default_rng(0)
    parts = [_documents(rng, np.uint16, n_docs=3) for _ in range(2)]
    for k, docs in enumerate(parts):
        _build(str(tmp_path / f"p{k}"), docs, np.uint16)
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(get_bin_path(merged), dtype=np.uint16)
    for k in range(2):
        builder.add_index(str(tmp_path / f"p{k}"))
    builder.finalize(get_idx_path(merged))
    direct = str(tmp_path / "direct")
    _build(direct, parts[0] + parts[1], np.uint16)
    for ext in (".idx", ".bin"):
        assert open(merged + ext, "rb").read() == open(direct + ext, "rb").read()
    other = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match="dtype uint16"):
        other.add_index(str(tmp_path / "p0"))


def test_optimal_dtype_and_codes():
    assert DType.optimal_dtype(65499) == np.uint16
    assert DType.optimal_dtype(65500) == np.int32
    for code, dtype in CODES.items():
        assert DType.code_from_dtype(dtype) == code
        assert DType.dtype_from_code(code) == dtype
        assert DType.size(code) == np.dtype(dtype).itemsize
    with pytest.raises(ValueError):
        DType.code_from_dtype(np.uint32)


def _corrupt(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset : offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize(
    "how, match",
    [
        ("magic", "magic"),
        ("version", "version 2"),
        ("dtype", "dtype code 9"),
        ("truncate", "does not match"),
        ("header", "truncated"),
        ("count", "does not match"),
        ("bin", "size"),
    ],
)
def test_corrupt_files_raise_value_error_naming_file(tmp_path, how, match):
    prefix = str(tmp_path / "ds")
    _build(prefix, [[np.arange(4)], [np.arange(3)]], np.int32)
    idx = get_idx_path(prefix)
    if how == "magic":
        _corrupt(idx, 0, b"XXIDIDX")
    elif how == "version":
        _corrupt(idx, 9, struct.pack("<Q", 2))
    elif how == "dtype":
        _corrupt(idx, 17, bytes([9]))
    elif how == "truncate":
        os.truncate(idx, os.path.getsize(idx) - 8)
    elif how == "header":
        os.truncate(idx, 20)
    elif how == "count":
        _corrupt(idx, 18, struct.pack("<Q", 3))
    elif how == "bin":
        os.truncate(get_bin_path(prefix), 8)
    with pytest.raises(ValueError, match=match) as err:
        IndexedDataset(prefix)
    assert "ds." in str(err.value)


def test_interrupted_finalize_leaves_no_idx(tmp_path, monkeypatch):
    prefix = str(tmp_path / "ds")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32)
    builder.add_item(np.arange(3))

    def fail(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(KeyboardInterrupt):
        builder.finalize(get_idx_path(prefix))
    assert os.listdir(tmp_path) == ["ds.bin"]


def _write_raw(prefix, lengths, pointers, docs, code=8, bin_bytes=None):
    """An .idx written field by field from megatron-compat.md §2 (no check of its consistency)."""
    lengths, pointers, docs = (np.asarray(a, dtype=t) for a, t in ((lengths, "<i4"), (pointers, "<i8"), (docs, "<i8")))
    with open(get_idx_path(prefix), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(docs)))
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())
    itemsize = np.dtype(CODES[code]).itemsize
    size = bin_bytes if bin_bytes is not None else int(pointers[-1]) + int(lengths[-1]) * itemsize
    with open(get_bin_path(prefix), "wb") as f:
        f.write(np.arange(size, dtype=np.uint8).tobytes())


@pytest.mark.parametrize(
    "lengths, pointers, docs, match",
    [
        # A negative length with pointers that follow it: once read as "the rest of the .bin".
        ([3, -2, 4], [0, 6, 2], [0, 3], "sequence 1 has length -2"),
        ([2, 2, 1], [0, 2, 4], [0, 3], "sequence 1 has pointer 2, but the lengths before it place it at byte 4"),
        ([2, 2], [4, 8], [0, 2], "sequence 0 has pointer 4.*pointer\\[0\\] must be 0"),
        ([1, 1, 1], [0, 2, 4], [0, 2, 1, 3], "document index entry 2 is 1 after 2"),
    ],
)
def test_index_arrays_validated_on_open(tmp_path, lengths, pointers, docs, match):
    prefix = str(tmp_path / "bad")
    _write_raw(prefix, lengths, pointers, docs)
    with pytest.raises(ValueError, match=match) as err:
        IndexedDataset(prefix)
    assert "bad.idx" in str(err.value)


def test_valid_raw_index_opens_and_empty_documents_repeat_entries(tmp_path):
    prefix = str(tmp_path / "ok")
    _write_raw(prefix, [2, 0, 3], [0, 4, 4], [0, 1, 1, 3])  # document 1 is empty
    ds = IndexedDataset(prefix)
    assert [len(ds[i]) for i in range(3)] == [2, 0, 3]


def test_validation_scans_in_chunks(tmp_path, monkeypatch):
    from megatron.core.datasets import indexed_dataset

    monkeypatch.setattr(indexed_dataset, "_CHECK_CHUNK", 2)  # every check crosses chunk borders
    n = 9
    lengths = np.arange(1, n + 1)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * 2])
    good = str(tmp_path / "good")
    _write_raw(good, lengths, pointers, list(range(n + 1)))
    assert len(IndexedDataset(good)) == n
    bad = str(tmp_path / "bad")
    wrong = pointers.copy()
    wrong[7] += 2
    _write_raw(bad, lengths, wrong, list(range(n + 1)))
    with pytest.raises(ValueError, match="sequence 7 has pointer"):
        IndexedDataset(bad)
    docs = list(range(n + 1))
    docs[5], docs[6] = docs[6], docs[5]
    _write_raw(bad, lengths, pointers, docs)
    with pytest.raises(ValueError, match="document index entry 6 is 5 after 6"):
        IndexedDataset(bad)


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_token_range_matches_every_token(tmp_path, chunk):
    prefix = str(tmp_path / "ds")
    docs = _documents(np.random.default_rng(5), np.int32, n_docs=8)
    docs[2][0] = np.array([-7, 12345], dtype=np.int32)
    _build(prefix, docs, np.int32)
    tokens = np.frombuffer(open(get_bin_path(prefix), "rb").read(), "<i4")  # independent read of the .bin
    assert IndexedDataset(prefix).token_range(chunk_tokens=chunk) == (int(tokens.min()), int(tokens.max()))
    empty = str(tmp_path / "empty")
    _build(empty, [[np.array([], dtype=np.int32)]], np.int32)
    assert IndexedDataset(empty).token_range() is None


def test_identity_follows_the_index_content(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    _build(a, [[np.array([1, 2, 3])], [np.array([4])]], np.uint16)
    _build(b, [[np.array([9, 9, 9])], [np.array([9])]], np.uint16)  # same lengths, other tokens
    _build(c, [[np.array([1, 2])], [np.array([3, 4])]], np.uint16)  # same tokens, other lengths
    ida, idb, idc = (IndexedDataset(p).identity() for p in (a, b, c))
    assert ida == idb  # the GPT indices depend on lengths and documents only
    assert ida["idx_digest"] != idc["idx_digest"] and ida["bin_bytes"] == idc["bin_bytes"]
