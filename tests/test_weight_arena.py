"""The weight arena: a GGUF's block-kernel matrices copied into one anonymous, huge-page-advised mapping at load
(tracer/load/weight_arena.py), value for value, each where the arena says, and nothing else moved."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch

from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.resolve import config_from_gguf_header
from llmtrace.tracer.core.errors import FileFormatError
from llmtrace.tracer.load import gguf_loader
from llmtrace.tracer.load.gguf_loader import _hold_mapped, load_gguf_stored, pack_matrices
from llmtrace.tracer.load.weight_arena import ALIGN, HUGE_PAGE, WeightArena
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import I8DOT, INT4PACK, NATIVE, pack_gguf

Q = gguf.GGMLQuantizationType


def test_place_copies_each_array_aligned_in_order() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, size=shape, dtype=np.uint8) for shape in ((3, 20), (1, 7), (5, 34))]
    arena = WeightArena(sum(a.nbytes for a in arrays), len(arrays))
    placed = [arena.place(a) for a in arrays]
    addresses = [p.ctypes.data for p in placed]
    assert addresses[0] % HUGE_PAGE == 0  # from the first 2 MiB boundary: whole huge pages
    assert all(address % ALIGN == 0 for address in addresses)
    assert addresses == sorted(addresses) and addresses[1] >= addresses[0] + arrays[0].nbytes
    for original, copy in zip(arrays, placed):
        assert copy.shape == original.shape and copy.dtype == original.dtype and copy.flags.writeable
        assert np.array_equal(copy, original) and not np.shares_memory(copy, original)
    if sys.platform == "linux":
        assert arena.advised  # Linux has MADV_HUGEPAGE; whether pages come is the kernel's THP setting


def test_place_refuses_what_does_not_fit() -> None:
    arena = WeightArena(100)
    assert HUGE_PAGE <= arena.free <= arena.capacity  # what lies after the first 2 MiB boundary
    arena.place(np.ones(arena.free - ALIGN, dtype=np.uint8))
    with pytest.raises(ValueError, match="weight arena full"):
        arena.place(np.zeros(ALIGN + 1, dtype=np.uint8))


def _resident_bytes(address: int) -> int:
    """Rss of the mapping that holds `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                rss = next(entry for entry in lines[i + 1:] if entry.startswith("Rss:"))
                return int(rss.split()[1]) * 1024
    raise AssertionError(f"{address:#x} is not mapped")


def test_populating_faults_the_arena_in_and_keeps_what_was_written() -> None:
    """populating() faults the taken part in from the end on a second thread while the caller writes from the front
    (issue 31: a 7B load's fresh pages); every byte the caller wrote, before or during it, stays as written."""
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in (3 * HUGE_PAGE + 5, 7 * HUGE_PAGE, 100)]
    arena = WeightArena(sum(a.nbytes for a in arrays), len(arrays))
    slots = [arena.take(a.nbytes) for a in arrays]
    slots[0][:10] = arrays[0][:10]  # written before the thread starts
    with arena.populating():
        for slot, array in zip(slots, arrays):
            slot[...] = array
    assert all(np.array_equal(slot, array) for slot, array in zip(slots, arrays))
    taken = slots[-1].ctypes.data + slots[-1].nbytes - slots[0].ctypes.data
    if sys.platform == "linux" and arena.populated:  # a kernel with MADV_POPULATE_WRITE (5.14+)
        assert taken <= arena.populated < taken + mmap.PAGESIZE
        assert _resident_bytes(slots[0].ctypes.data) >= taken


def test_populating_an_empty_arena_runs_nothing() -> None:
    arena = WeightArena(100)
    with arena.populating():
        pass
    assert arena.populated == 0


@pytest.fixture(scope="module")
def tiny_q8(tiny_quantized: Callable[..., Path]) -> Path:
    return tiny_quantized(Q.Q8_0)


def _mapped_file(address: int) -> str:
    """The path of the file mapped at `address` in this process ("" for anonymous memory), from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")


def _span(blocks: list[np.ndarray]) -> tuple[int, int]:
    return min(b.ctypes.data for b in blocks), max(b.ctypes.data + b.nbytes for b in blocks)


def test_native_matrices_read_as_stored_live_in_the_files_map_and_q_k_in_one_arena(tiny_q8: Path) -> None:
    """Issue 31 (load <= llama.cpp's): the matrices the native kernel reads as the file stores them are the file's
    own bytes in a private map of it (no copy, no fresh pages), the embedding included; Q and K, whose rows llama.cpp
    permuted, are put in HF's order in one arena, back to back. Every matrix holds the bytes the file holds."""
    header = read_gguf_header(tiny_q8)
    config = config_from_gguf_header(header)
    _, packed = load_gguf_stored(header, config, torch.float32, NATIVE)
    blocks = {name: w.tensors["blocks"].numpy() for name, w in packed.items()}
    permuted = {n: b for n, b in blocks.items() if n.endswith(("attention.wq.weight", "attention.wk.weight"))}
    in_file = {n: b for n, b in blocks.items() if n not in permuted}
    assert len(permuted) == 2 * config.n_layers and "tok_embeddings.weight" in in_file and len(in_file) > len(permuted)
    assert all(b.ctypes.data % ALIGN == 0 for b in permuted.values())
    low, high = _span(list(permuted.values()))
    total = sum(b.nbytes for b in permuted.values())
    assert high - low < total + len(permuted) * ALIGN  # back to back: one arena, no gaps beyond alignment
    file_view = np.memmap(tiny_q8, dtype=np.uint8, mode="r")
    offsets = {info.name: header.data_offset + info.offset for info in header.tensors}
    ours = {"tok_embeddings.weight": "token_embd.weight", "output.weight": "output.weight",
            "layers.1.attention.wv.weight": "blk.1.attn_v.weight", "layers.0.feed_forward.w2.weight":
            "blk.0.ffn_down.weight"}
    bases = set()
    for name, gguf_name in ours.items():
        held = in_file[name].reshape(-1)
        start = offsets[gguf_name]
        assert np.array_equal(held, file_view[start:start + held.nbytes]), name
        bases.add(held.ctypes.data - start)  # one map: every matrix at the map's start + its offset
    assert len(bases) == 1
    if sys.platform == "linux":
        assert {_mapped_file(b.ctypes.data) for b in in_file.values()} == {str(tiny_q8)}
        assert {_mapped_file(b.ctypes.data) for b in permuted.values()} == {""}  # anonymous memory


def test_a_map_that_cannot_be_guarded_is_not_used(tiny_q8: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the SIGBUS handler cannot take the map (every slot taken, no handler installed), a truncated file
    would kill the run silently (exit 135): the matrices are then copied into the arena, as before the map."""

    class Unguarded(gguf_loader.FileMap):
        def __init__(self, source: Any) -> None:
            super().__init__(source)
            self.guarded = False

    monkeypatch.setattr(gguf_loader, "FileMap", Unguarded)
    header = read_gguf_header(tiny_q8)
    config = config_from_gguf_header(header)
    _, packed = load_gguf_stored(header, config, torch.float32, NATIVE)
    file_view = np.memmap(tiny_q8, dtype=np.uint8, mode="r")
    offsets = {info.name: header.data_offset + info.offset for info in header.tensors}
    held = packed["layers.0.feed_forward.w2.weight"].tensors["blocks"].numpy().reshape(-1)
    start = offsets["blk.0.ffn_down.weight"]
    assert np.array_equal(held, file_view[start:start + held.nbytes])  # the file's bytes, copied
    if sys.platform == "linux":
        places = {_mapped_file(w.tensors["blocks"].data_ptr()) for w in packed.values()}
        assert places <= {"", "[heap]"}, places  # anonymous memory, never the file's map


def test_an_arena_only_for_block_kernels(tiny_q8: Path) -> None:
    header = read_gguf_header(tiny_q8)
    config = config_from_gguf_header(header)
    names = ["layers.0.attention.wo.weight", "layers.0.feed_forward.w2.weight"]
    native = pack_matrices(header, config, names, NATIVE)
    first, second = (native[n].tensors["blocks"].numpy() for n in names)  # type: ignore[union-attr]
    assert second.ctypes.data - first.ctypes.data < first.nbytes + ALIGN  # placed one after the other
    int4 = pack_matrices(header, config, ["layers.0.attention.wo.weight"], {"Q8_0": INT4PACK})
    assert "blocks" not in int4["layers.0.attention.wo.weight"].tensors  # type: ignore[union-attr]


def test_i8dot_q4_matrices_are_held_once_interleaved_in_the_arena(tiny_quantized: Callable[..., Path]) -> None:
    """An i8dot Q4_1 matrix is held once (issue 31: its rows beside their interleaved copy held a 7B Q4_0 model
    twice): its bytes in the arena, every whole group of sixteen rows interleaved in place (what its products read),
    in the model's row order (Q/K rows unpermuted as they are placed), never in a map of the file (a truncation would
    be SIGBUS: issue 27); resident bytes = stored bytes. Products (one token and several), dequantization and row
    lookups equal those of the file's rows in the model's order, packed plainly."""
    path = tiny_quantized(Q.Q4_1)
    header = read_gguf_header(path)
    config = config_from_gguf_header(header)
    _, packed = load_gguf_stored(header, config, torch.float32, I8DOT)
    reference = load_gguf_stored(header, config, torch.float32, NATIVE)[1]  # the rows as stored, model order
    for name in ("layers.0.feed_forward.w2.weight", "layers.0.attention.wq.weight", "layers.1.attention.wk.weight"):
        weight = packed[name]
        assert set(weight.tensors) == {"groups"}, name
        held = weight.tensors["groups"]
        rows = reference[name].tensors["blocks"]
        assert weight.stored_bytes == held.nbytes == rows.nbytes and weight.resident_bytes == weight.stored_bytes
        assert weight.native_matrix().groups[0].data_ptr() == held.data_ptr() and held.data_ptr() % ALIGN == 0
        if sys.platform == "linux":
            assert _mapped_file(held.data_ptr()) == ""
        whole = weight.shape[0] // native_kernel.GROUP_ROWS * native_kernel.GROUP_ROWS
        assert torch.equal(held.view(-1)[:whole * held.shape[1]],
                           native_kernel.interleave(int(Q.Q4_1), rows, weight.shape[1]))
        assert torch.equal(held[whole:], rows[whole:])
        plain = pack_gguf(rows.numpy().copy(), int(Q.Q4_1), weight.shape[1], I8DOT)
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        assert torch.equal(weight(x), plain(x)) and torch.equal(weight(x[:1]), plain(x[:1]))
        assert torch.equal(weight.dequantize(), reference[name].dequantize())
        ids = torch.tensor([0, weight.shape[0] - 1, 9, 3])
        assert torch.equal(weight.rows(ids, torch.float32), reference[name].rows(ids, torch.float32))


def test_a_cached_plan_keeps_i8dot_matrices_interleaved_in_place(tiny_quantized: Callable[..., Path],
                                                                 tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan that mixes i8dot with a torch kernel is cached (its int4pack tensors are converted): the i8dot Q4_0
    matrices go into the entry as they are held ("groups", interleaved in place) and come back as such, so a load
    from the entry gives the converting load's logits bit for bit."""
    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.load.loader import load_model

    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tiny_quantized(Q.Q4_0, Q.Q8_0))
    tokens = torch.tensor([[1, 5, 9, 14, 3]])
    logits = []
    for expect_cached in (False, True):
        loaded = load_model(path, FP32, weights="Q4_0:i8dot,Q8_0:int4pack")
        assert loaded.from_cache == expect_cached
        wq = loaded.model.layers[0].attention.wq.packed
        assert set(wq.tensors) == {"groups"} and wq.format.kernel == I8DOT
        loaded.model.setup_cache(1, 8)
        logits.append(loaded.model.prefill(tokens))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_arena_copies_from_the_map_equal_those_read_with_pread(tiny_quantized: Callable[..., Path], qtype: Q,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31 (load <= llama.cpp's): the matrices copied into the arena (i8dot's interleaved Q4_0, Q/K rows put
    in HF's order) are written from the file's map in one pass; they hold the bytes the pread path writes, and a
    NaN scale in one is refused in one line either way."""
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")
    path = tiny_quantized(qtype)
    header = read_gguf_header(path)
    config = config_from_gguf_header(header)
    kernel = I8DOT if qtype == Q.Q4_0 else NATIVE
    _, mapped = load_gguf_stored(header, config, torch.float32, kernel)

    class Unguarded(gguf_loader.FileMap):
        def __init__(self, source: Any) -> None:
            super().__init__(source)
            self.guarded = False

    with monkeypatch.context() as patch:
        patch.setattr(gguf_loader, "FileMap", Unguarded)
        _, read = load_gguf_stored(header, config, torch.float32, kernel)
    assert mapped.keys() == read.keys()
    for name, weight in mapped.items():
        assert weight.tensors.keys() == read[name].tensors.keys(), name
        for part, tensor in weight.tensors.items():
            assert torch.equal(tensor, read[name].tensors[part]), (name, part)
    bad = path.parent / "nan-scale.gguf"
    data = bytearray(path.read_bytes())
    name = "blk.1.attn_v.weight" if qtype == Q.Q4_0 else "blk.1.attn_k.weight"  # interleaved; Q/K rows reordered
    info = next(i for i in header.tensors if i.name == name)
    at = header.data_offset + info.offset + info.n_bytes // 2 // (info.n_bytes // info.torch_shape[0]) * (
        info.n_bytes // info.torch_shape[0])  # the first block of a row halfway down
    data[at:at + 2] = np.array([np.nan], dtype="<f2").tobytes()
    bad.write_bytes(bytes(data))
    bad_header = read_gguf_header(bad)
    held = []
    monkeypatch.setattr(gguf_loader, "_hold_mapped", lambda *a: held.append(a[0]) or _hold_mapped(*a))
    with pytest.raises(FileFormatError, match=f"{name}' holds NaN or infinite scales"):
        load_gguf_stored(bad_header, config, torch.float32, kernel)
    assert held  # through the map's one pass, not pread
