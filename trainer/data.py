"""Token batches: a deterministic synthetic stream, or a tokenized file (.npy / .bin of token ids).

A file is one stream of ids (.bin: uint16, or int32 past 65536 tokens; .npy: 1-d;
a Megatron indexed-dataset prefix, PREFIX.bin typed by PREFIX.idx),
cut into windows of seq + 1 that overlap by one token; or a 2-d .npy of explicit
samples, one [seq + 1] row each (to replay another framework's exact batch).

Sample `i` is always the same `seq + 1` tokens (inputs are the first `seq`, targets
the last `seq`), whatever the layout, so "the same batches" means "the same sample
indices": update number `s` (1-based) uses samples [(s-1)*B, s*B) of the global
batch B, and the data position saved in a checkpoint is just the samples consumed.

The synthetic stream is learnable (arithmetic progressions modulo the vocabulary,
with 10% random tokens), so loss curves go down and a resumed run visibly continues.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from interop.errors import InteropError


class TokenData:
    def __init__(self, vocab: int, seq: int, seed: int = 1234, path=None):
        self.vocab, self.seq, self.seed = vocab, seq, seed
        self.tokens = None if path is None else _open_tokens(Path(path), vocab)
        if self.tokens is not None and self.tokens.ndim == 2:  # one sample per row
            if self.tokens.shape[1] != seq + 1:
                raise InteropError(f"{path}: rows hold {self.tokens.shape[1]} tokens, --seq-length {seq} needs {seq + 1}")
            self.count = self.tokens.shape[0]
        elif self.tokens is not None:
            self.count = (len(self.tokens) - 1) // seq
            if self.count < 1:
                raise InteropError(f"{path}: {len(self.tokens)} tokens, fewer than one sample of {seq + 1}")

    def sample(self, i: int) -> np.ndarray:
        if self.tokens is not None:
            if self.tokens.ndim == 2:
                out = np.asarray(self.tokens[i % self.count], dtype=np.int64)
            else:
                start = (i % self.count) * self.seq
                out = np.asarray(self.tokens[start:start + self.seq + 1], dtype=np.int64)
            if out.max() >= self.vocab or out.min() < 0:
                raise InteropError(f"token ids in sample {i} fall outside the vocabulary [0, {self.vocab})")
            return out
        rng = np.random.default_rng([self.seed, i])
        start, stride = rng.integers(self.vocab), rng.integers(1, 8)
        out = (start + stride * np.arange(self.seq + 1)) % self.vocab
        noise = rng.random(self.seq + 1) < 0.1
        out[noise] = rng.integers(self.vocab, size=int(noise.sum()))
        return out.astype(np.int64)

    def batch(self, first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [first, first + size) as (inputs [size, seq], targets [size, seq])."""
        rows = torch.from_numpy(np.stack([self.sample(i) for i in range(first, first + size)]))
        return rows[:, :-1], rows[:, 1:]


# Megatron's indexed dataset (`PREFIX.idx` + `PREFIX.bin`): the .idx header names the token dtype.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def _megatron_prefix(path: Path):
    """Token ids of a Megatron `--data-path` prefix, read as one stream (document boundaries ignored)."""
    idx, bin_ = path.with_name(path.name + ".idx"), path.with_name(path.name + ".bin")
    head = idx.read_bytes()[:18]
    if head[:9] != _IDX_MAGIC or head[17] not in _IDX_DTYPES:
        raise InteropError(f"{idx}: not a Megatron indexed-dataset index (or an unknown token dtype)")
    return np.memmap(bin_, dtype=_IDX_DTYPES[head[17]], mode="r")


def _open_tokens(path: Path, vocab: int):
    if not path.is_file() and path.with_name(path.name + ".idx").is_file() \
            and path.with_name(path.name + ".bin").is_file():
        return _megatron_prefix(path)
    if not path.is_file():
        raise InteropError(f"{path}: data file not found")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as exc:
            raise InteropError(f"{path}: not a readable .npy file ({exc})") from None
        if arr.ndim not in (1, 2) or arr.dtype.kind not in "iu":
            raise InteropError(f"{path}: expected integer token ids, a 1-d stream or 2-d [samples, seq + 1], "
                               f"got {arr.dtype} {arr.shape}")
        return arr
    if path.suffix == ".bin":
        dtype = np.uint16 if vocab <= 65536 else np.int32
        if path.stat().st_size % np.dtype(dtype).itemsize:
            raise InteropError(f"{path}: size is not a multiple of {np.dtype(dtype).itemsize} bytes ({np.dtype(dtype).name} ids)")
        return np.memmap(path, dtype=dtype, mode="r")
    raise InteropError(f"{path}: data must be a .npy or .bin file of token ids")
