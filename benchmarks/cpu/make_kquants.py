"""K-quant GGUF files of a small model, made by llama.cpp's own quantizer (the workload "Your own GGUF vs
llama.cpp" in WORKLOADS.md): an F16 GGUF is written from a source GGUF (its metadata and tokenizer copied, every
matrix de-quantized to float16 by the gguf package), then ``llama_model_quantize`` (llama-cpp-python) makes
Q4_K_M, Q5_K_M, Q6_K and Q8_0 files from it, as a user's ``llama-quantize`` would.

    python -m benchmarks.cpu.make_kquants --source FILE.gguf --out DIR --llama-cpp-dir DIR [--types Q4_K_M ...]

The default source is the packaged SmolLM2-135M-Instruct (Q4_1): its F16 file holds the Q4_1 values, so the
K-quants are of those weights (fine for speed, and for comparing two engines on the same file).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

# llama.cpp's llama_ftype values
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def write_f16(source: Path, target: Path) -> Path:
    """``source``'s metadata and tensors, matrices as float16 (norms and vectors as float32)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(source)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)
    writer.add_file_type(1)  # mostly F16
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).reshape(
            [int(d) for d in reversed(tensor.shape)]
        )
        if values.ndim >= 2:
            writer.add_tensor(
                tensor.name, values.astype(np.float16), raw_dtype=GGMLQuantizationType.F16
            )
        else:
            writer.add_tensor(tensor.name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def quantize(source: Path, target: Path, ftype: str, llama_cpp_dir: str | None) -> Path:
    if llama_cpp_dir:
        sys.path.insert(0, llama_cpp_dir)
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 2
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if code != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {code}")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", help="a GGUF file (default: the packaged default model)")
    parser.add_argument("--out", required=True, help="directory for the files")
    parser.add_argument(
        "--llama-cpp-dir", help="import llama-cpp-python from DIR (a pip --target build)"
    )
    parser.add_argument(
        "--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"], choices=FTYPES
    )
    args = parser.parse_args(argv)
    if args.source:
        source = Path(args.source)
    else:
        from engine.worker.model_sources import default_gguf_file

        source = default_gguf_file()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    f16 = write_f16(source, out / f"{source.stem}.F16.gguf")
    print(f"{f16} ({f16.stat().st_size >> 20} MiB) in {time.perf_counter() - start:.1f} s")
    for ftype in args.types:
        start = time.perf_counter()
        made = quantize(
            f16, out / f"{source.stem.split('.')[0]}.{ftype}.gguf", ftype, args.llama_cpp_dir
        )
        print(f"{made} ({made.stat().st_size >> 20} MiB) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
