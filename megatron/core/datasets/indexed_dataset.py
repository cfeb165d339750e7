"""Megatron's memory-mapped indexed dataset (``MMIDIDX``): a ``.bin`` of tokens and an ``.idx`` index.

The byte layout is fixed by Megatron-LM (see ``shared/docs/megatron-compat.md`` §2):

    .idx  magic b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 N | u64 D
          | int32 lengths[N] | int64 pointers[N] | int64 document_index[D] | int8 modes[N] (multimodal)
    .bin  all sequences concatenated in the dtype, no header

This module imports NumPy only (no torch): the preprocessing tool loads it and must start fast.
Torch tensors passed to the builder are accepted through ``numpy.asarray``.
"""

from __future__ import annotations

import array
import enum
import hashlib
import os
import shutil
import struct
from typing import Any, Dict, Iterable, List, Optional, Tuple, Type, Union

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
# magic (9) + version (8) + dtype code (1) + N (8) + D (8)
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34

ArrayLike = Any  # numpy array, torch tensor, list of ints ...
# Entries per vectorised validation step: bounded temporaries on indices of billions of sequences.
_CHECK_CHUNK = 1 << 22
# Tokens per step of the token range scan of a .bin.
_SCAN_CHUNK = 1 << 24
# Files already fully validated / hashed by this process, keyed by their stat identity.
_VALIDATED: set = set()
_DIGESTS: Dict[Tuple[int, ...], str] = {}


def _stat_key(path: str) -> Tuple[int, ...]:
    """What identifies one version of a file: device, inode, size and modification time (ns)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class DType(enum.Enum):
    """The dtype codes stored in byte 17 of an ``.idx`` file."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: Union[Type[np.number], np.dtype, str]) -> int:
        """Code of a NumPy dtype; ``ValueError`` if the format cannot store it."""
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} cannot be stored in an indexed dataset")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, code: int) -> Type[np.number]:
        """NumPy scalar type of a code; ``ValueError`` for an unknown code."""
        try:
            return getattr(np, cls(code).name)
        except ValueError:
            raise ValueError(f"unknown dtype code {code}") from None

    @staticmethod
    def size(key: Union[int, Type[np.number], np.dtype]) -> int:
        """Bytes per item of a code or a dtype."""
        if isinstance(key, int) and not isinstance(key, bool):
            return np.dtype(DType.dtype_from_code(key)).itemsize
        return np.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[np.number]:
        """Smallest token dtype Megatron uses for a vocabulary of ``cardinality`` entries."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def get_idx_path(path_prefix: str) -> str:
    """Path of the index file of a dataset prefix."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """Path of the data file of a dataset prefix."""
    return path_prefix + ".bin"


class _Index:
    """The parsed, validated contents of one ``.idx`` file (arrays are read-only views)."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        self.path = idx_path
        if not os.path.isfile(idx_path):
            raise FileNotFoundError(f"index file not found: {idx_path}")
        file_size = os.path.getsize(idx_path)
        if file_size < HEADER_SIZE:
            raise ValueError(f"{idx_path}: truncated index ({file_size} bytes, header needs {HEADER_SIZE})")
        with open(idx_path, "rb") as f:
            magic, version, code, n, d = _HEADER.unpack(f.read(HEADER_SIZE))
        if magic != _MAGIC:
            raise ValueError(f"{idx_path}: not an MMIDIDX index (magic bytes {magic!r})")
        if version != _VERSION:
            raise ValueError(f"{idx_path}: unsupported index version {version} (expected {_VERSION})")
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise ValueError(f"{idx_path}: unknown dtype code {code}") from None
        expected = HEADER_SIZE + 12 * n + 8 * d + (n if multimodal else 0)
        if file_size != expected:
            hint = ""
            if not multimodal and file_size == expected + n:
                hint = " (the file has sequence modes: open it with multimodal=True)"
            raise ValueError(
                f"{idx_path}: size {file_size} bytes does not match N={n} sequences and D={d} "
                f"document entries, which need {expected} bytes{hint}"
            )
        self._map_arrays(n, d, multimodal)
        key = _stat_key(idx_path)
        if key not in _VALIDATED:  # a reopened, unchanged file (data-loader workers) is not rescanned
            self._check_lengths_and_pointers()
            self._check_document_index(n)
            _VALIDATED.add(key)

    def _map_arrays(self, n: int, d: int, multimodal: bool) -> None:
        # The index can be large (12 bytes per sentence); map it instead of reading it.
        buf = np.memmap(self.path, mode="r", dtype=np.uint8)
        self._mmap = buf
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=n, offset=off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=off)
        off += 8 * n
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=d, offset=off)
        off += 8 * d
        self.sequence_modes = np.frombuffer(buf, dtype=np.int8, count=n, offset=off) if multimodal else None

    def _check_lengths_and_pointers(self) -> None:
        """Lengths >= 0 and ``pointer[i] = sum(length[j] * itemsize for j < i)``, in chunks."""
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        itemsize = np.dtype(self.dtype).itemsize
        start = 0  # byte where the next sequence must begin
        for a in range(0, len(lengths), _CHECK_CHUNK):
            lens = lengths[a : a + _CHECK_CHUNK].astype(np.int64)
            negative = np.flatnonzero(lens < 0)
            if negative.size:
                i = a + int(negative[0])
                raise ValueError(
                    f"{self.path}: sequence {i} has length {int(lengths[i])} (sequence lengths must be >= 0)"
                )
            ends = start + np.cumsum(lens * itemsize)
            starts = np.concatenate(([start], ends[:-1]))
            bad = np.flatnonzero(pointers[a : a + len(lens)] != starts)
            if bad.size:
                i = a + int(bad[0])
                raise ValueError(
                    f"{self.path}: sequence {i} has pointer {int(pointers[i])}, but the lengths before it "
                    f"place it at byte {int(starts[bad[0]])} (pointer[0] must be 0 and pointer[i+1] = "
                    f"pointer[i] + length[i] x {itemsize} bytes of {np.dtype(self.dtype).name})"
                )
            start = int(ends[-1])

    def _check_document_index(self, n: int) -> None:
        """Starts at 0, ends at N and never decreases (empty documents repeat an entry)."""
        doc = self.document_indices
        if len(doc) == 0 or doc[0] != 0 or doc[-1] != n:
            first = int(doc[0]) if len(doc) else None
            last = int(doc[-1]) if len(doc) else None
            raise ValueError(
                f"{self.path}: document index must start at 0 and end at N={n} (found first={first}, last={last})"
            )
        for a in range(0, len(doc) - 1, _CHECK_CHUNK):
            step = np.diff(doc[a : a + _CHECK_CHUNK + 1])
            bad = np.flatnonzero(step < 0)
            if bad.size:
                k = a + int(bad[0]) + 1
                raise ValueError(
                    f"{self.path}: document index entry {k} is {int(doc[k])} after "
                    f"{int(doc[k - 1])} (entries must not decrease from 0 to N={n})"
                )

    def digest(self) -> str:
        """BLAKE2b of the header, lengths, document index and modes: the index's content identity.

        Pointers are left out: validation makes them a function of the lengths and the dtype.
        """
        key = _stat_key(self.path)
        if key not in _DIGESTS:
            h = hashlib.blake2b(digest_size=16)
            h.update(np.asarray(self._mmap[:HEADER_SIZE]).tobytes())
            for arr in (self.sequence_lengths, self.document_indices, self.sequence_modes):
                if arr is not None:
                    h.update(memoryview(arr).cast("B"))
            _DIGESTS[key] = h.hexdigest()
        return _DIGESTS[key]

    def bin_size(self) -> int:
        """Bytes the ``.bin`` must hold according to this index."""
        if len(self.sequence_lengths) == 0:
            return 0
        itemsize = np.dtype(self.dtype).itemsize
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize


class IndexedDataset:
    """Read-only view of a Megatron ``MMIDIDX`` dataset.

    Args:
        path_prefix: dataset path without ``.bin`` / ``.idx``.
        multimodal: whether the index carries one int8 mode per sequence.
        mmap: memory-map the ``.bin`` (zero-copy reads); ``False`` reads it with plain file I/O.

    ``ds[i]`` is sequence ``i`` as a NumPy array (``(array, mode)`` when multimodal); ``ds[a:b]``
    is a list of them. Megatron-core's other arguments: object storage (``object_storage_config``,
    ``s3_config``) is not supported yet; ``fast_cache_load`` changes nothing (the index is always
    memory-mapped); ``sequences_per_dataset`` ((sequences, documents)) and ``dtype_code``, which
    upstream trusts instead of reading the header, are checked against it (``ValueError``).
    """

    def __init__(
        self,
        path_prefix: str,
        multimodal: bool = False,
        mmap: bool = True,
        object_storage_config: Any = None,
        s3_config: Any = None,
        fast_cache_load: bool = False,
        sequences_per_dataset: Optional[Tuple[int, int]] = None,
        dtype_code: Optional[int] = None,
    ) -> None:
        if s3_config is not None:
            raise NotImplementedError("IndexedDataset: s3_config (object storage) is not supported yet")
        self.initialize(
            path_prefix, multimodal, mmap, object_storage_config, fast_cache_load, sequences_per_dataset, dtype_code
        )

    def initialize(
        self,
        path_prefix: str,
        multimodal: bool,
        mmap: bool,
        object_storage_config: Any,
        fast_cache_load: bool = False,
        sequences_per_dataset: Optional[Tuple[int, int]] = None,
        dtype_code: Optional[int] = None,
    ) -> None:
        """(Re)open the files at ``path_prefix`` (Megatron-core's name; see the class docstring)."""
        if object_storage_config is not None:
            raise NotImplementedError("IndexedDataset: object_storage_config is not supported yet")
        self._open(path_prefix, multimodal, mmap)
        found = (len(self.sequence_lengths), len(self.document_indices) - 1)
        if sequences_per_dataset is not None and tuple(sequences_per_dataset) != found:
            raise ValueError(f"{path_prefix}: sequences_per_dataset={sequences_per_dataset}, the index has {found}")
        if dtype_code is not None and DType.dtype_from_code(dtype_code) != self.dtype:
            raise ValueError(f"{path_prefix}: dtype_code={dtype_code}, the index holds {np.dtype(self.dtype).name}")

    def _open(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.index = _Index(get_idx_path(path_prefix), multimodal)
        bin_path = get_bin_path(path_prefix)
        if not os.path.isfile(bin_path):
            raise FileNotFoundError(f"data file not found: {bin_path}")
        size, expected = os.path.getsize(bin_path), self.index.bin_size()
        if size != expected:
            raise ValueError(f"{bin_path}: size {size} bytes, but its index describes {expected} bytes")
        self._bin_file = None
        self._bin_buffer: Any = b""
        if mmap:
            if size > 0:  # an empty file cannot be mapped
                self._bin_buffer = np.memmap(bin_path, mode="r", dtype=np.uint8)
        else:
            self._bin_file = open(bin_path, "rb")

    def __getstate__(self) -> Tuple[str, bool, bool]:
        # Data-loader workers reopen the files rather than pickle mapped memory.
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state: Tuple[str, bool, bool]) -> None:
        self._open(*state)

    def __del__(self) -> None:
        f = getattr(self, "_bin_file", None)
        if f is not None:
            f.close()

    def __len__(self) -> int:
        return len(self.index.sequence_lengths)

    @property
    def dtype(self) -> Type[np.number]:
        """NumPy scalar type of the tokens."""
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 ``[N]``: tokens per sequence."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 ``[N]``: byte offset of each sequence in the ``.bin``."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 ``[D]``: sequence index where each document starts, then ``N``."""
        return self.index.document_indices

    def get_document_indices(self) -> np.ndarray:
        """``document_indices`` (Megatron-core's accessor)."""
        return self.index.document_indices

    def set_document_indices(self, document_indices: np.ndarray) -> None:
        """Replace the document boundaries in memory (the files are untouched), as upstream allows.

        Raises:
            ValueError: not non-decreasing int boundaries from 0 to the number of sequences.
        """
        doc = np.asarray(document_indices, dtype=np.int64)
        n = len(self.sequence_lengths)
        if doc.ndim != 1 or doc.size == 0 or doc[0] != 0 or doc[-1] != n or (np.diff(doc) < 0).any():
            raise ValueError(f"document_indices must rise from 0 to the number of sequences {n}")
        self.index.document_indices = doc

    @property
    def sequence_modes(self) -> Optional[np.ndarray]:
        """int8 ``[N]`` modes of a multimodal dataset, else ``None``."""
        return self.index.sequence_modes

    def identity(self) -> Dict[str, Any]:
        """Content identity of the files: sizes plus the index digest (equal for re-written equal data).

        Everything the GPT indices depend on (lengths, documents, dtype) is covered, so it keys
        their cache; modification times are left out on purpose (a copy keeps its cache).
        """
        return {
            "idx_bytes": os.path.getsize(get_idx_path(self.path_prefix)),
            "idx_digest": self.index.digest(),
            "bin_bytes": os.path.getsize(get_bin_path(self.path_prefix)),
        }

    def token_range(self, chunk_tokens: int = _SCAN_CHUNK) -> Optional[Tuple[int, int]]:
        """Smallest and largest token id in the ``.bin`` (None when it holds no token).

        Reads the file once in chunks of ``chunk_tokens`` into one reused buffer (bounded memory).
        """
        total = self.index.bin_size() // np.dtype(self.dtype).itemsize
        if total == 0:
            return None
        buf = np.empty(min(chunk_tokens, total), dtype=self.dtype)
        low, high = None, None
        with open(get_bin_path(self.path_prefix), "rb") as f:
            done = 0
            while done < total:
                view = buf[: min(len(buf), total - done)]
                if f.readinto(memoryview(view).cast("B")) != view.nbytes:
                    raise ValueError(f"{get_bin_path(self.path_prefix)}: short read at token {done}")
                low = view.min() if low is None else min(low, view.min())
                high = view.max() if high is None else max(high, view.max())
                done += len(view)
        return int(low), int(high)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both ``.idx`` and ``.bin`` of a prefix exist."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=self.dtype)
        if self._bin_file is None:
            return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=count, offset=byte_offset)
        out = np.empty(count, dtype=self.dtype)
        nbytes = out.nbytes
        # pread keeps no file position, so concurrent readers of one handle cannot interfere.
        data = os.pread(self._bin_file.fileno(), nbytes, byte_offset)
        if len(data) != nbytes:
            raise ValueError(f"{get_bin_path(self.path_prefix)}: short read at byte {byte_offset}")
        out.view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        return out

    def _with_mode(self, i: int, tokens: np.ndarray) -> Union[np.ndarray, Tuple[np.ndarray, int]]:
        if self.multimodal:
            return tokens, int(self.sequence_modes[i])
        return tokens

    def _check_idx(self, idx: int) -> int:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences")
        return idx

    def __getitem__(self, idx: Union[int, np.integer, slice]) -> Any:
        if isinstance(idx, slice):
            return self._get_slice(idx)
        if isinstance(idx, (int, np.integer)):
            i = self._check_idx(int(idx))
            tokens = self._read(int(self.sequence_pointers[i]), int(self.sequence_lengths[i]))
            return self._with_mode(i, tokens)
        raise TypeError(f"indices must be integers or slices, not {type(idx).__name__}")

    def _get_slice(self, sl: slice) -> List[Any]:
        start, stop, step = sl.indices(len(self))
        if step != 1 or start >= stop:
            return [self[i] for i in range(start, stop, step)]
        # Contiguous sequences are contiguous in the .bin: one read, then split.
        lengths = self.sequence_lengths[start:stop]
        flat = self._read(int(self.sequence_pointers[start]), int(lengths.sum()))
        parts = np.split(flat, np.cumsum(lengths)[:-1])
        return [self._with_mode(start + k, p) for k, p in enumerate(parts)]

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> Any:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when ``length`` is None)."""
        i = self._check_idx(int(idx))
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"get({idx}, offset={offset}, length={length}): sequence has {seq_len} tokens")
        itemsize = np.dtype(self.dtype).itemsize
        tokens = self._read(int(self.sequence_pointers[i]) + offset * itemsize, length)
        return self._with_mode(i, tokens)


class IndexedDatasetBuilder:
    """Writes a ``.bin`` while sequences arrive and the ``.idx`` in ``finalize``.

    Args:
        bin_path: the ``.bin`` file to create.
        dtype: token dtype (one of the eight ``DType`` members).
        multimodal: record one int8 mode per sequence.
    """

    def __init__(self, bin_path: str, dtype: Type[np.number] = np.int32, multimodal: bool = False) -> None:
        DType.code_from_dtype(dtype)  # reject unstorable dtypes before creating files
        self.dtype = np.dtype(dtype)
        self.multimodal = multimodal
        self.bin_path = bin_path
        self._data_file = open(bin_path, "wb")
        # Compact typed arrays: a Python list of ints costs ~4x the memory per sequence.
        self.sequence_lengths = array.array("i")
        self.document_indices = array.array("q", [0])
        self.sequence_modes = array.array("b")

    def _write_tokens(self, tokens: ArrayLike) -> int:
        arr = np.ascontiguousarray(np.asarray(tokens), dtype=self.dtype).reshape(-1)
        self._data_file.write(memoryview(arr).cast("B"))
        return arr.size

    def add_item(self, tensor: ArrayLike, mode: int = 0) -> None:
        """Append one sequence (any array-like of tokens)."""
        self.sequence_lengths.append(self._write_tokens(tensor))
        if self.multimodal:
            self.sequence_modes.append(mode)

    def _append_sequences(self, tokens: ArrayLike, lengths: ArrayLike, modes: Optional[ArrayLike]) -> None:
        lengths_arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
        count = self._write_tokens(tokens)
        if int(lengths_arr.sum()) != count:
            raise ValueError(f"lengths sum to {int(lengths_arr.sum())} but {count} tokens were given")
        self.sequence_lengths.frombytes(lengths_arr.astype(np.int32).tobytes())
        if self.multimodal:
            m = np.zeros(len(lengths_arr), np.int8) if modes is None else np.asarray(modes, np.int8)
            self.sequence_modes.frombytes(m.reshape(-1).tobytes())

    def add_document(self, tensor: ArrayLike, lengths: Iterable[int], modes: Optional[Iterable[int]] = None) -> None:
        """Append a whole document: flat tokens cut into sequences of ``lengths``, then end it."""
        self._append_sequences(tensor, list(lengths), None if modes is None else list(modes))
        self.end_document()

    def add_documents(self, tokens: ArrayLike, lengths: ArrayLike, doc_ends: ArrayLike) -> None:
        """Append many documents in one write (the preprocessing tool's bulk path).

        Args:
            tokens: all tokens of the documents, flat.
            lengths: tokens per sequence; sums to ``len(tokens)``.
            doc_ends: per document, the count of its and all earlier sequences in ``lengths``
                (the cumulative number of sequences at each document's end).
        """
        base = len(self.sequence_lengths)
        self._append_sequences(tokens, lengths, None)
        ends = np.asarray(doc_ends, dtype=np.int64).reshape(-1) + base
        self.document_indices.frombytes(ends.tobytes())

    def end_document(self) -> None:
        """Close the current document: the next sequence starts a new one."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (same dtype) after what was written so far."""
        other = _Index(get_idx_path(path_prefix), self.multimodal)
        if np.dtype(other.dtype) != self.dtype:
            raise ValueError(
                f"{get_idx_path(path_prefix)}: dtype {np.dtype(other.dtype).name} does not match "
                f"the dataset being built ({self.dtype.name})"
            )
        base = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(np.ascontiguousarray(other.sequence_lengths).tobytes())
        docs = np.asarray(other.document_indices[1:], dtype=np.int64) + base
        self.document_indices.frombytes(docs.tobytes())
        if self.multimodal:
            self.sequence_modes.frombytes(np.ascontiguousarray(other.sequence_modes).tobytes())
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._data_file, 16 * 1024 * 1024)

    def close(self) -> None:
        """Close the ``.bin`` without writing an index (an abandoned build)."""
        self._data_file.close()

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx`` atomically (temporary name, then rename)."""
        self._data_file.close()
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()  # sequences after the last end_document form one document
        write_index(
            idx_path,
            self.dtype,
            self.sequence_lengths,
            self.document_indices,
            self.sequence_modes if self.multimodal else None,
        )


def temporary_prefix(path_prefix: str) -> str:
    """Where a new dataset for ``path_prefix`` is written until it is complete (unique per process)."""
    return f"{path_prefix}.tmp{os.getpid()}"


def remove_dataset(path_prefix: str) -> None:
    """Delete the ``.idx`` (first: an ``.idx`` never outlives its ``.bin``) and ``.bin`` of a prefix, if present."""
    for path in (get_idx_path(path_prefix), get_bin_path(path_prefix)):
        if os.path.exists(path):
            os.remove(path)


def publish_dataset(tmp_prefix: str, path_prefix: str) -> None:
    """Move the complete dataset at ``tmp_prefix`` to ``path_prefix``, replacing any old one.

    Order: remove the old ``.idx``, rename the new ``.bin``, then rename the new ``.idx``. Until the
    first step the old pair is untouched; at any moment (also after a kill between the steps) a
    reader finds the old pair, no ``.idx`` at all, or the new pair; never an ``.idx`` beside a
    ``.bin`` it does not describe.
    """
    for path in (get_idx_path(tmp_prefix), get_bin_path(tmp_prefix)):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"cannot publish {path_prefix}: {path} is missing")
    if os.path.exists(get_idx_path(path_prefix)):
        os.remove(get_idx_path(path_prefix))
    os.replace(get_bin_path(tmp_prefix), get_bin_path(path_prefix))
    os.replace(get_idx_path(tmp_prefix), get_idx_path(path_prefix))


def write_index(
    idx_path: str,
    dtype: Union[Type[np.number], np.dtype],
    sequence_lengths: ArrayLike,
    document_indices: ArrayLike,
    sequence_modes: Optional[ArrayLike] = None,
) -> None:
    """Write an ``.idx`` file; it appears under its final name only once complete."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32).reshape(-1)
    docs = np.asarray(document_indices, dtype=np.int64).reshape(-1)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    header = _HEADER.pack(_MAGIC, _VERSION, DType.code_from_dtype(dtype), len(lengths), len(docs))
    tmp_path = f"{idx_path}.tmp{os.getpid()}"
    try:
        with open(tmp_path, "wb") as f:
            f.write(header)
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(docs.tobytes())
            if sequence_modes is not None:
                f.write(np.asarray(sequence_modes, dtype=np.int8).tobytes())
        os.replace(tmp_path, idx_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
