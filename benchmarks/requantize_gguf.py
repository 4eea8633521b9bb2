"""A real model's GGUF requantized to another block type, metadata and tokenizer kept: the bundled SmolLM2-135M
(Q4_1, its embedding/head Q8_0) as an all-Q8_0 file, for checking a Q8_0 kernel's numerics on real weights
(random-weight files have near-tied logits, so their top-1 agreement says nothing).

Every quantized matrix is dequantized exactly (gguf.quants.dequantize) and quantized again (gguf.quants.quantize,
the reference quantizer llama.cpp's own matches); float tensors (norms) are copied as they are. The values are the
source file's values rounded onto the new type's grid: a Q4_1 model's weights on Q8_0's finer grid are its Q4_1
values within half a Q8_0 step, so the file is a real model whose products are Q8_0 blocks.

    /work/tools/py -m benchmarks.requantize_gguf --to Q8_0 --out /tmp/h1q8/SmolLM2-135M-Instruct.Q8_0.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
FILE_TYPES = {"Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1}


def requantize(source: Path, out: Path, to: str) -> dict[str, int]:
    """Write `source` with every quantized matrix as `to`; {type name: tensors} of what was written."""
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own counts and the architecture the writer was given
        value = FILE_TYPES[to] if name == "general.file_type" else field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    target = GGMLQuantizationType[to]
    written: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type in FLOAT_TYPES:
            data, qtype = np.asarray(tensor.data), tensor.tensor_type
        else:  # (rows, bytes) in, (rows, columns) of values, (rows, bytes) of the new type out
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
            data, qtype = quantize(values, target), target
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)  # uint8 data: the writer reads its shape as bytes
        written[qtype.name] = written.get(qtype.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="the source GGUF (default: the bundled model)")
    parser.add_argument("--to", default="Q8_0", choices=sorted(FILE_TYPES))
    parser.add_argument("--out", type=Path, required=True, help="the GGUF to write (its folder is made)")
    args = parser.parse_args()
    from llmtrace.tracer.checkpoint.bundled import bundled_model_path

    source = args.model or bundled_model_path()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = requantize(source, args.out, args.to)
    print(f"{source} -> {args.out} ({args.out.stat().st_size:,} bytes): "
          + ", ".join(f"{n} {t}" for t, n in sorted(written.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
