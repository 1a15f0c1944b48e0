"""Lazy reading of a Hugging Face safetensors checkpoint, one tensor at a time.

A checkpoint is either one `model.safetensors` or a `model.safetensors.index.json` whose
`weight_map` names the shard of every tensor. Only headers are read up front (names, shapes,
dtypes); tensor data is read when `iter_tensors` reaches it, so a loader holds at most one
HF tensor beside what it has already converted. bfloat16 arrives as `ml_dtypes.bfloat16`, and
float8 (`F8_E4M3`, `F8_E5M2`, which safetensors' numpy reader cannot make) as
`ml_dtypes.float8_e4m3fn` / `float8_e5m2`, read from the file's bytes at the header's offsets.
"""

import collections
import json
import os
import struct
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxpaged.checkpoint.format import SAFETENSORS_FILE as SINGLE_FILE
from jaxpaged.checkpoint.format import SAFETENSORS_INDEX_FILE as INDEX_FILE
from jaxpaged.checkpoint.hf_keys import format_names

# Safetensors dtypes that `safe_open(framework="np")` cannot return (it looks for them in numpy
# itself), read as raw bytes and viewed as the ml_dtypes type instead.
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}


class SafetensorsCheckpoint:
    """The tensors of one HF checkpoint directory, located but not yet read.

    Args:
      model_dir: a directory holding `model.safetensors` or `model.safetensors.index.json`
        (the index wins when both exist).

    Raises:
      FileNotFoundError: no safetensors checkpoint, or a shard named by the index is missing.
      ValueError: a tensor name present in two shards (or twice in the index), or an index
        entry whose shard lacks the tensor.
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = os.fspath(model_dir)
        self.bytes_read = 0  # tensor data read so far (`iter_tensors`)
        files = self._shard_files()
        # Headers only: name -> every file that holds it, to catch duplicates across shards.
        found: dict[str, list[str]] = collections.defaultdict(list)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for path in files:
            with safe_open(path, framework="np") as f:
                for name in f.keys():
                    found[name].append(os.path.basename(path))
                    tensor = f.get_slice(name)
                    self._shapes[name] = tuple(tensor.get_shape())
                    self._dtypes[name] = tensor.get_dtype()
        duplicates = {n: fs for n, fs in found.items() if len(fs) > 1}
        if duplicates:
            detail = format_names(f"{n} (in {', '.join(fs)})" for n, fs in duplicates.items())
            raise ValueError(f"duplicate tensors in {self.model_dir}: {detail}; each tensor must be stored once")
        self.locations = {name: os.path.join(self.model_dir, fs[0]) for name, fs in found.items()}
        if self._weight_map is not None:
            lost = [n for n in self._weight_map if n not in self.locations]
            if lost:
                raise ValueError(
                    f"{INDEX_FILE} in {self.model_dir} lists tensors that no shard holds: {format_names(lost)}"
                )

    def _shard_files(self) -> list[str]:
        index_path = os.path.join(self.model_dir, INDEX_FILE)
        single_path = os.path.join(self.model_dir, SINGLE_FILE)
        self._weight_map: dict[str, str] | None = None
        if os.path.isfile(index_path):
            self._weight_map = _read_weight_map(index_path)
            files = sorted(set(self._weight_map.values()))
            paths = [os.path.join(self.model_dir, f) for f in files]
            missing = [f for f, p in zip(files, paths) if not os.path.isfile(p)]
            if missing:
                raise FileNotFoundError(f"{index_path} names shards that do not exist: {format_names(missing)}")
            return paths
        if os.path.isfile(single_path):
            return [single_path]
        raise FileNotFoundError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {self.model_dir}; pass a Hugging Face model "
            "directory saved with safetensors (or a directory written by jaxpaged-convert)"
        )

    @property
    def names(self) -> list[str]:
        """Every tensor name in the checkpoint, sorted."""
        return sorted(self.locations)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of `name`, from the header (no data read)."""
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        """The stored dtype of `name` in safetensors' spelling ("F32", "BF16", "F8_E4M3", ...), from
        the header (no data read)."""
        return self._dtypes[name]

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """Yields `(name, array)` one at a time, file by file, each file opened once.

        Args:
          names: the tensors to read (default: all); names not in the checkpoint raise KeyError.
        """
        wanted = self.names if names is None else list(names)
        by_file: dict[str, list[str]] = collections.defaultdict(list)
        for name in wanted:
            by_file[self.locations[name]].append(name)
        for path in sorted(by_file):
            offsets = None
            with safe_open(path, framework="np") as f:
                for name in by_file[path]:
                    if self._dtypes[name] not in RAW_DTYPES:
                        array = f.get_tensor(name)
                    else:
                        if offsets is None:
                            offsets = _data_offsets(path)
                        array = _read_raw(path, offsets[name], RAW_DTYPES[self._dtypes[name]], self._shapes[name])
                    self.bytes_read += array.nbytes
                    yield name, array


def _data_offsets(path: str) -> dict[str, tuple[int, int]]:
    """name -> (start, end) byte offsets of every tensor's data in a safetensors file (the
    format: an 8-byte little-endian header length, the JSON header, then the data)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {
        name: (8 + length + entry["data_offsets"][0], 8 + length + entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _read_raw(path: str, span: tuple[int, int], dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor's little-endian bytes viewed as `dtype` (a one-byte type) in `shape`."""
    start, end = span
    count = end - start
    if count != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"{path}: a tensor of shape {list(shape)} and dtype {dtype} spans {count} bytes")
    data = np.fromfile(path, dtype=np.uint8, count=count, offset=start)
    if data.size != count:
        raise ValueError(f"{path} is truncated: a tensor's data ends past the end of the file")
    return data.view(dtype).reshape(shape)


def _read_weight_map(index_path: str) -> dict[str, str]:
    """The index's `weight_map`, refusing a tensor name listed twice (JSON would keep the last)."""

    def no_duplicates(pairs):
        counts = collections.Counter(k for k, _ in pairs)
        repeated = [k for k, c in counts.items() if c > 1]
        if repeated:
            raise ValueError(f"duplicate tensors in {index_path}: {format_names(repeated)}")
        return dict(pairs)

    with open(index_path) as f:
        index = json.load(f, object_pairs_hook=no_duplicates)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path} has no 'weight_map' object; is it a safetensors index?")
    return weight_map
