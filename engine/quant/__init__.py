"""Weight quantization (int8, int4 group-wise, fp8) and the layers that use it; see
quantize.py for the formats, linear.py for where each runs."""
from .linear import (METHODS, QuantEmbedding, QuantExperts, QuantLinear, check_method, quantize_model,
                     to_cpu_kernels, weight_bytes)
from .quantize import (Fp8Weight, Int4Weight, Int8Weight, dequantize_fp8, dequantize_int4,
                       dequantize_int8, quantize_fp8, quantize_int4, quantize_int8)

__all__ = ["METHODS", "QuantEmbedding", "QuantExperts", "QuantLinear", "check_method",
           "quantize_model", "to_cpu_kernels", "weight_bytes", "Int8Weight", "Int4Weight", "Fp8Weight", "quantize_int8",
           "quantize_int4", "quantize_fp8", "dequantize_int8", "dequantize_int4", "dequantize_fp8"]
