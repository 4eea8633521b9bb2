"""The i8dot kernel's Q4_0/Q4_1 rows interleaved in groups of sixteen (tracer/model/native/int8_groups.c): the layout
as that file documents it, built here in numpy, and every output row bit for bit what the kernel gives the row
without the interleaved copy (each row alone, in the GGUF's own layout), whatever the row count, the thread count
or where a part (so a thread's range) starts. The products' closeness to the exact ones is test_int8_dot.py's."""

from __future__ import annotations

import ctypes
import dataclasses

import gguf
import numpy as np
import pytest
import torch

from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.transformer import Transformer
from llmtrace.tracer.model.weight_formats import I8DOT, concat_rows, finite_scales, pack_gguf
from tests.tiny_gguf import random_blocks
from tests.torch_threads import torch_threads

Q = gguf.GGMLQuantizationType
GROUPED = [Q.Q4_0, Q.Q4_1]
G = native_kernel.GROUP_ROWS  # rows a group


@pytest.fixture
def native() -> None:
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")


def documented_layout(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Whole groups of sixteen rows: per group and 32-value block the sixteen fp16 d, (Q4_1) the sixteen fp16 m,
    then 4 x 64 code bytes, vector v holding bytes 4v..4v+3 of each row's 16 in row order."""
    head = 4 if qtype == Q.Q4_1 else 2
    rows, row_bytes = raw.shape
    blocks = raw[: rows // G * G].reshape(rows // G, G, row_bytes // (head + 16), head + 16)  # (g, row, b, bytes)
    blocks = blocks.transpose(0, 2, 1, 3)  # (g, b, row, bytes)
    scales = blocks[..., :head].reshape(*blocks.shape[:3], head // 2, 2)  # (g, b, row, field, 2)
    scales = scales.transpose(0, 1, 3, 2, 4)  # (g, b, field, row, 2)
    codes = blocks[..., head:].reshape(*blocks.shape[:3], 4, 4).transpose(0, 1, 3, 2, 4)  # (g, b, v, row, 4)
    g, b = blocks.shape[:2]
    return np.concatenate([scales.reshape(g, b, head * G), codes.reshape(g, b, 16 * G)], axis=2).reshape(-1)


@pytest.mark.parametrize("qtype", GROUPED, ids=lambda q: q.name)
def test_the_interleaved_copy_is_the_documented_layout(qtype: Q, native: None) -> None:
    for rows in (7, 16, 37):
        raw = random_blocks(qtype, rows, 96, np.random.default_rng(rows))
        grouped = native_kernel.interleave(int(qtype), torch.from_numpy(raw), 96).numpy()
        assert grouped.nbytes == native_kernel.grouped_bytes(int(qtype), rows, 96) == rows // G * G * raw.shape[1]
        assert np.array_equal(grouped, documented_layout(raw, qtype))


@pytest.mark.parametrize("qtype", GROUPED, ids=lambda q: q.name)
def test_rows_read_with_a_stride_interleave_to_the_documented_layout(qtype: Q, native: None) -> None:
    """The loader interleaves strided views (a head's even rows, then its odd ones: llama.cpp's Q/K row order put
    back) at 7B's widths and narrower; the vector build's transposes write what the layout says."""
    for rows, cols, step in ((32, 4096, 2), (40, 64, 3), (17, 32, 1)):
        raw = random_blocks(qtype, rows * step, cols, np.random.default_rng(rows + cols))
        view = torch.from_numpy(raw)[::step]
        grouped = native_kernel.interleave(int(qtype), view, cols).numpy()
        assert np.array_equal(grouped, documented_layout(np.ascontiguousarray(raw[::step]), qtype))


@pytest.mark.parametrize("qtype", GROUPED, ids=lambda q: q.name)
def test_the_portable_build_interleaves_to_the_documented_layout(qtype: Q, portable_build: None) -> None:
    """Builds without AVX2 move the bytes one row's block at a time: the same layout (the loader's arena and a
    weights-cache entry hold it whichever build wrote them)."""
    if not native_kernel.available():
        pytest.skip(f"no C build here: {native_kernel.unavailable_reason()}")
    assert not native_kernel.library().avx2
    for rows, cols, step in ((37, 96, 1), (32, 64, 2)):
        raw = random_blocks(qtype, rows * step, cols, np.random.default_rng(rows))
        grouped = native_kernel.interleave(int(qtype), torch.from_numpy(raw)[::step], cols).numpy()
        assert np.array_equal(grouped, documented_layout(np.ascontiguousarray(raw[::step]), qtype))


@pytest.mark.parametrize("qtype", GROUPED, ids=lambda q: q.name)
def test_every_row_has_the_bits_it_has_without_the_interleaved_copy(qtype: Q, native: None) -> None:
    """Rows that are not a multiple of sixteen, parts (so thread ranges) starting at any row, 1 and 2 threads: each
    output equals the matrix described without its interleaved copy (every row by the one-row kernel)."""
    cols = 576
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(int(qtype))) * 3
    for rows in (1, 8, 16, 21, 37, 301):
        raw = random_blocks(qtype, rows, cols, np.random.default_rng(rows))
        plain = native_kernel.BlockMatrix([(int(qtype), torch.from_numpy(raw))], cols, (native_kernel.INT8_X,))
        assert plain.groups == (None,)
        weight = pack_gguf(raw, int(qtype), cols, I8DOT)
        assert weight.native_matrix().groups[0] is not None
        for threads in (1, 2):
            with torch_threads(threads):
                want = native_kernel.matmul(plain, x)
                assert torch.equal(weight(x), want), (rows, threads)
                for start in sorted({1, 3, rows // 2, rows - 1} - {0}):  # a second part from row `start`
                    if start >= rows:
                        continue
                    split = concat_rows([pack_gguf(raw[:start], int(qtype), cols, I8DOT),
                                         pack_gguf(raw[start:], int(qtype), cols, I8DOT)])
                    assert torch.equal(split(x), want), (rows, threads, start)


@pytest.mark.parametrize("qtype", GROUPED, ids=lambda q: q.name)
def test_a_prefill_reads_the_interleaved_copy_and_gives_each_token_its_decode_bits(qtype: Q, native: None) -> None:
    """Several tokens at once (prefill) read the interleaved copy too (issue 31: so the file's rows are not held
    beside it): each token's outputs are its one-token product's bits, 1 and 2 threads; and once the copy is made,
    overwriting the rows of the whole groups changes nothing (they are not read), the rows after them still are."""
    cols = 576
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(7)) * 3
    for rows in (8, 16, 21, 301):
        raw = random_blocks(qtype, rows, cols, np.random.default_rng(rows))
        weight = pack_gguf(raw, int(qtype), cols, I8DOT)
        assert weight.native_matrix().groups[0] is not None
        for threads in (1, 2):
            with torch_threads(threads):
                prefill = weight(x)
                decode = torch.cat([weight(x[i:i + 1]) for i in range(x.shape[0])])
            assert torch.equal(prefill, decode), (rows, threads)
        # One thread: a thread's share of the rows that starts inside a group of sixteen takes that group's rows
        # before its first whole group from the rows (a few rows per thread: their pages fault back in).
        whole = rows // G * G
        with torch_threads(1):
            raw[:whole] = 0  # the rows the copy holds (pack_gguf kept `raw` itself: a writable array)
            assert torch.equal(weight(x)[:, :whole], prefill[:, :whole])
            if whole < rows:  # the control: rows that are read do change the product when overwritten
                raw[whole:] = 0
                assert not torch.equal(weight(x)[:, whole:], prefill[:, whole:])


def test_interleaved_rows_only_for_an_i8dot_q4_part(native: None) -> None:
    raw = random_blocks(Q.Q4_1, 16, 64, np.random.default_rng(0))
    grouped = native_kernel.interleave(int(Q.Q4_1), torch.from_numpy(raw), 64)
    with pytest.raises(native_kernel.NativeKernelError, match="unsupported ggml type"):  # the exact kernel's part
        native_kernel.BlockMatrix([(int(Q.Q4_1), torch.from_numpy(raw))], 64, (native_kernel.EXACT_X,), (grouped,))
    with pytest.raises(ValueError, match="not the interleaved rows"):  # sized for other rows
        native_kernel.BlockMatrix([(int(Q.Q4_1), torch.from_numpy(raw[:8]))], 64, (native_kernel.INT8_X,), (grouped,))
    with pytest.raises(native_kernel.NativeKernelError, match="unsupported ggml type"):
        native_kernel.interleave(int(Q.Q8_0), torch.from_numpy(raw), 64)


def held_in_place(raw: np.ndarray, qtype: Q, cols: int) -> np.ndarray:
    """`raw`'s rows as the loader holds an i8dot Q4_0/Q4_1 matrix: its whole groups interleaved in place (the
    documented layout), the rows after them as stored."""
    whole = raw.shape[0] // G * G
    return np.concatenate([documented_layout(raw, qtype), raw[whole:].reshape(-1)]).reshape(raw.shape)


@pytest.mark.parametrize("qtype", GROUPED, ids=lambda q: q.name)
def test_a_matrix_held_in_place_is_read_only_through_its_groups(qtype: Q, native: None) -> None:
    """A matrix held once, interleaved in place (issue 31: no rows beside the copy), gives every output the bits
    of the plain rows: one token and five, 1 and 2 threads (whose ranges start inside groups), parts starting at
    any row (their prefill: that of the same parts held as rows); its values (dequantize, a range, row lookups in and after the whole groups) are the plain rows', and
    the C reference product reads its rows through their groups too. Nothing else is held."""
    cols = 576
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(11)) * 3
    reference = native_kernel.library().handle.llmt_matmul_reference
    reference.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    for rows in (8, 16, 37, 301):
        raw = random_blocks(qtype, rows, cols, np.random.default_rng(rows))
        plain = pack_gguf(raw, int(qtype), cols, I8DOT)
        weight = pack_gguf(held_in_place(raw, qtype, cols), int(qtype), cols, I8DOT, interleaved=True)
        assert set(weight.tensors) == {"groups"} and weight.resident_bytes == weight.stored_bytes == raw.nbytes
        assert finite_scales(weight)
        for threads in (1, 2):
            with torch_threads(threads):
                for tokens in (x[:1], x):
                    assert torch.equal(weight(tokens), plain(tokens)), (rows, threads, tokens.shape[0])
                for start in sorted({1, 3, 9, rows // 2, rows - 1} - {0}):
                    if start >= rows:
                        continue
                    split = concat_rows([
                        pack_gguf(held_in_place(raw[:start], qtype, cols), int(qtype), cols, I8DOT, interleaved=True),
                        pack_gguf(held_in_place(raw[start:], qtype, cols), int(qtype), cols, I8DOT, interleaved=True)])
                    assert set(split.tensors) == {f"groups.0.{qtype.name}", f"groups.1.{qtype.name}"}
                    apart = concat_rows([pack_gguf(raw[:start].copy(), int(qtype), cols, I8DOT),
                                         pack_gguf(raw[start:].copy(), int(qtype), cols, I8DOT)])
                    assert torch.equal(split(x[:1]), plain(x[:1])), (rows, start)
                    assert torch.equal(split(x), apart(x)), (rows, start)  # the parts' prefill as without
                    assert torch.equal(split.dequantize(), plain.dequantize())
        assert torch.equal(weight.dequantize(), plain.dequantize())
        assert torch.equal(weight.dequantize(start=rows // 3, stop=rows), plain.dequantize(start=rows // 3, stop=rows))
        ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
        assert torch.equal(weight.rows(ids, torch.float32), plain.rows(ids, torch.float32))
        matrix, plain_matrix = weight.native_matrix(), plain.native_matrix()
        got, want = (torch.empty(2, rows) for _ in range(2))
        assert reference(matrix.address, x.data_ptr(), 2, got.data_ptr(), None) == 0
        assert reference(plain_matrix.address, x.data_ptr(), 2, want.data_ptr(), None) == 0
        assert torch.equal(got, want)


def test_a_matrix_held_in_place_has_its_scales_checked_in_its_groups(native: None) -> None:
    """finite_scales finds a NaN scale in an interleaved group and in a row after the whole groups."""
    raw = random_blocks(Q.Q4_1, 13, 64, np.random.default_rng(3))
    for row, field in ((2, 0), (5, 2), (12, 0)):  # d of row 2, m of row 5 (in groups), d of row 12 (after them)
        bad = raw.copy()
        bad[row, field:field + 2] = np.array([np.nan], dtype="<f2").view(np.uint8)
        weight = pack_gguf(held_in_place(bad, Q.Q4_1, 64), int(Q.Q4_1), 64, I8DOT, interleaved=True)
        assert not finite_scales(weight), (row, field)
    with pytest.raises(ValueError, match="not read interleaved"):
        pack_gguf(raw, int(Q.Q4_1), 64, "native", interleaved=True)


def test_a_tied_embedding_held_in_place_is_looked_up_through_its_groups(native: None) -> None:
    """A tied Q4_0 embedding / LM head on i8dot (Llama 3.2 1B's Q4_0 file) held in place: the native decode step's
    lookup (decode_step.c's embed) and the torch path's (PackedWeight.rows) gather each row from its group, so the
    two paths agree as they do on rows held as stored (test_native_step's tolerance), and a lookup, in the whole
    groups or after them, is gguf's dequantized row."""
    from tests.test_native_step import BASE, assert_same_steps

    config = dataclasses.replace(BASE, vocab_size=101, tie_embeddings=True)  # 12 whole groups, then 5 rows
    torch.manual_seed(0)
    state = {name: t.detach().clone() for name, t in Transformer(config).state_dict().items()}
    packed, raws = {}, {}
    for name, tensor in list(state.items()):
        if tensor.dim() == 2:
            raws[name] = gguf.quants.quantize(tensor.numpy().astype(np.float32), Q.Q4_0)
            packed[name] = pack_gguf(held_in_place(raws[name], Q.Q4_0, tensor.shape[1]), int(Q.Q4_0),
                                     tensor.shape[1], I8DOT, interleaved=True)
            del state[name]
    model = Transformer(config)
    model.load_stored(state, packed)
    model.eval()
    for threads in (1, 2):
        with torch_threads(threads):
            assert_same_steps(model)
    table = packed["tok_embeddings.weight"]
    ids = torch.tensor([0, 100, 97, 8, 95, 96])
    want = gguf.quants.dequantize(raws["tok_embeddings.weight"], Q.Q4_0)[ids.numpy()]
    assert torch.equal(table.rows(ids, torch.float32), torch.from_numpy(want))


@pytest.mark.parametrize("qtype", GROUPED, ids=lambda q: q.name)
def test_the_loaders_one_pass_holds_rows_read_with_a_stride(qtype: Q, native: None) -> None:
    """native_kernel.hold_groups (the loader's pass from the file's map into the arena, issue 31: load <= llama.cpp's)
    writes rows read with any stride (a half-head's rows lie two apart in llama.cpp's order) as they are held in
    place, on one thread and two (each writing its own share), and finds every scale finite."""
    for rows, cols, step in ((37, 96, 1), (64, 4096, 2), (17, 32, 1), (5, 64, 3)):
        raw = random_blocks(qtype, rows * step, cols, np.random.default_rng(rows + step))
        view = raw[::step]
        want = held_in_place(np.ascontiguousarray(view), qtype, cols)
        for threads in (1, 2):
            out = np.zeros_like(want)
            with torch_threads(threads):
                assert native_kernel.hold_groups(int(qtype), view, cols, out)
            assert np.array_equal(out, want), (rows, cols, step, threads)


@pytest.mark.parametrize("qtype", GROUPED, ids=lambda q: q.name)
def test_the_loaders_one_pass_finds_a_scale_that_is_not_finite(qtype: Q, native: None) -> None:
    """A NaN or an infinite d (or Q4_1's m) in a whole group or in a row after them: hold_groups says so (the loader
    then refuses the file in one line), and has written every byte all the same."""
    raw = random_blocks(qtype, 37, 64, np.random.default_rng(5))
    fields = (0, 2) if qtype == Q.Q4_1 else (0,)
    for row in (2, 20, 36):
        for field in fields:
            for value in (np.nan, np.inf, -np.inf):
                bad = raw.copy()
                bad[row, field:field + 2] = np.array([value], dtype="<f2").view(np.uint8)  # the row's first block
                out = np.zeros_like(bad)
                with torch_threads(2):
                    assert not native_kernel.hold_groups(int(qtype), bad, 64, out), (row, field, value)
                assert np.array_equal(out, held_in_place(bad, qtype, 64))
    out = np.zeros_like(raw)
    with pytest.raises(ValueError, match="cannot hold"):
        native_kernel.hold_groups(int(qtype), raw, 64, out[:-1])


def test_q_and_k_rows_from_the_map_are_put_in_hf_order_once(native: None) -> None:
    """The loader's Q/K rows from the file's map (gguf_loader._hold_mapped): llama.cpp's permuted rows unpermuted a
    half-head at a time, interleaved in place for i8dot's Q4_0/Q4_1, copied as stored for the others; heads whose
    halves are not whole groups of sixteen are left to the reading path (None)."""
    from llmtrace.tracer.load.gguf_loader import _hold_mapped, unpermute_rope_rows

    heads, cols = 3, 64
    for qtype in (*GROUPED, Q.Q8_0):
        interleaved = qtype in GROUPED
        raw = random_blocks(qtype, heads * 64, cols, np.random.default_rng(int(qtype)))
        hf = unpermute_rope_rows(raw, heads)
        want = held_in_place(hf, qtype, cols) if interleaved else hf
        out, released = np.zeros_like(raw), []
        with torch_threads(2):
            assert _hold_mapped(int(qtype), raw, heads, out, cols, interleaved,
                                lambda start, n: released.append((start, n))) is True
        assert np.array_equal(out, want), qtype.name
        assert released == [(0, raw.nbytes)]  # its map pages given back once copied
        bad = raw.copy()
        bad[70, :2] = np.array([np.nan], dtype="<f2").view(np.uint8)
        assert _hold_mapped(int(qtype), bad, heads, np.zeros_like(raw), cols, interleaved, lambda s, n: None) is False
    small = random_blocks(Q.Q4_0, 4 * 16, cols, np.random.default_rng(1))  # heads of 16 rows: halves of eight
    assert _hold_mapped(int(Q.Q4_0), small, 4, np.zeros_like(small), cols, True, lambda s, n: None) is None


def test_a_big_matrix_is_written_from_the_map_piece_by_piece(native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of whole heads (or groups), each piece's map pages given back after it (a 148 MB tied embedding is
    not resident twice at the end of its pass): the same bytes as in one piece."""
    from llmtrace.tracer.load import gguf_loader

    heads, cols = 4, 64
    raw = random_blocks(Q.Q4_1, heads * 64 + 0, cols, np.random.default_rng(9))
    row_bytes = raw.shape[1]
    for heads_given, want in ((heads, held_in_place(gguf_loader.unpermute_rope_rows(raw, heads), Q.Q4_1, cols)),
                              (None, held_in_place(raw, Q.Q4_1, cols))):
        monkeypatch.setattr(gguf_loader, "_MAP_PIECE_BYTES", 64 * row_bytes)  # a head (or four groups) a piece
        out, released = np.zeros_like(raw), []
        assert gguf_loader._hold_mapped(int(Q.Q4_1), raw, heads_given, out, cols, True,
                                        lambda start, n: released.append((start, n)))
        assert np.array_equal(out, want)
        assert released == [(i * 64 * row_bytes, 64 * row_bytes) for i in range(heads)]
