"""tessera_rt.models: trainable models built from ``nn``'s modules, beside ``nn.Transformer``.

* ``llama``: ``LlamaLM``, a Llama-shaped language model (RoPE, grouped-query attention,
  RMSNorm, SwiGLU, an untied head) that ``scripts/train.py --arch llama`` trains on any mesh
  ``nn.Transformer`` does, and ``export_hf``, which writes it as a Hugging Face Llama
  checkpoint (``nn.Llama.from_pretrained`` and transformers load it; serving a run is
  ``inference.runs.load_run``).

It sits beside ``moe`` and ``pipeline`` (above ``nn``, ``op`` and ``dist``; below ``inference``).
"""
from .llama import LlamaLM, export_hf

__all__ = ["LlamaLM", "export_hf"]
