"""Quantized weights: `formats` (FP8 128x128 blocks, MXFP8, MXFP4: quantize,
dequantize, the reference matmul, load-time checks).  `kimik3.quantization` holds the manifests
that assign a format to each param and counts their bytes."""

from kimik3.quant.formats import FORMATS, QTensor, check, dequantize, error_bound, matmul_ref, quantize

__all__ = ["FORMATS", "QTensor", "check", "dequantize", "error_bound", "matmul_ref", "quantize"]
