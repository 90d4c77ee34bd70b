"""tessera_rt.kernels: tile ops with a NumPy reference each, and GPU implementations.

Each op module registers its NumPy reference as the "cpu" kernel (``register_kernel``);
the ``*_cuda`` modules register GPU launchers that import CuPy only when called; where a
vendor library serves an op (``providers``: cuDNN attention, cuBLASLt GEMMs) the GPU entry
tries it first.  The backend picks the implementation: ``get_backend().kernel("matmul")``;
``use_providers(False)`` (or ``TESSERA_KERNELS=own``) forces the project's own kernels.  Everything in
``__all__`` is re-exported into the public ``op`` namespace.
"""
# the modules in the order of the comments below (references, then the kernels that replace
# them in the table), not sorted:
# isort: off
from .numerics import NumericPolicy, numeric
from .gemm import gemm, matmul
from .norms import layernorm, layernorm_safe, rmsnorm, rmsnorm_safe, softmax
from .fp8 import dequantize_fp8, fake_quantize_fp8, quantize_fp8
from .mlp import bias_act, bias_gelu, bias_silu, dual_matmul, gelu, silu, swiglu
from .attention import flash_attention, flash_attention_backward
from .paged_attention import paged_decode_attention
from .grouped_gemm import (grouped_dual_matmul, grouped_matmul, grouped_matmul_wgrad, grouped_matmul_wgrad_dual,
                           grouped_swiglu)
from .spectral import conv2d_direct, conv2d_fft, fft2d, ifft2d
# the fused CPU kernels (Numba) replace the references in the CPU kernel table; the references
# stay importable from their modules as the oracle
from . import cpu_fused, cpu_attention  # noqa: F401  (they register their kernels)
from .cpu_fused import softmax_cross_entropy
# the fused training-step ops (kernel table only): references and CPU entries, then GPU launchers
from . import fused_ref, embedding, multi_tensor  # noqa: F401  (they register their kernels)
# GPU launchers: they register, and import CuPy only on call
from . import gemm_cuda, attention_cuda, rows_cuda, paged_attention_cuda  # noqa: F401  (they register their kernels)
from . import fused_cuda, xent_cuda, embedding_cuda, optim_cuda, grouped_gemm_cuda  # noqa: F401  (they register their kernels)
from .varlen_attention import flash_attention_varlen
from .prefill_attention import paged_prefill_attention as paged_prefill_attention
# the fused ops of a decoder step (inference.Llama): references, then the GPU kernels
from . import decoder_ops, decoder_cuda, varlen_attention_cuda  # noqa: F401  (they register their kernels)
from .gemm_epilogue import matmul_bias_act, matmul_fp8
# vendor providers (cuDNN attention, cuBLASLt GEMMs): register, import their libraries only on use
from . import providers, cudnn_attention, cudnn_varlen, cublaslt_gemm, cublas_grouped  # noqa: F401  (they register)
from .providers import providers_enabled as providers_enabled, use_providers as use_providers
from . import tile
from .tile_kernels import saxpy
from .compile import inspect_ir
from .autotuner import autotune
# isort: on

__all__ = [
    "NumericPolicy", "numeric",
    "matmul", "gemm", "softmax", "layernorm", "layernorm_safe", "rmsnorm", "rmsnorm_safe",
    "quantize_fp8", "dequantize_fp8", "fake_quantize_fp8",
    "bias_act", "bias_gelu", "bias_silu", "gelu", "silu", "swiglu", "dual_matmul",
    "flash_attention", "flash_attention_backward", "flash_attention_varlen", "paged_decode_attention",
    "grouped_matmul", "grouped_dual_matmul", "grouped_swiglu", "grouped_matmul_wgrad", "grouped_matmul_wgrad_dual",
    "softmax_cross_entropy", "matmul_bias_act", "matmul_fp8",
    "conv2d_fft", "conv2d_direct", "fft2d", "ifft2d",
    "saxpy", "tile", "inspect_ir", "autotune",
]
