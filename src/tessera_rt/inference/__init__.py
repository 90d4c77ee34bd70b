"""tessera_rt.inference: Llama-architecture models from Hugging Face checkpoints, decoded
tensor-parallel through a paged, tp-sharded KV cache with vocab-parallel sampling.

    model = nn.Llama.from_pretrained("dir", mesh=mesh)          # config.json + *.safetensors
    cache = nn.KVCache(model, max_tokens=4096, block_size=16)
    out = model.generate(cache, prompts=[[1, 2, 3]], max_new_tokens=32)
"""
from ..deprecation import aliases as _aliases
from ..nn import UPPER as _NN_UPPER
from .generate import generate
from .hf import CheckpointReader, LlamaConfig, rope_inv_freq
from .kv_cache import KVCache
from .llama import Llama, TPShard
from .sampling import sample

_NN_UPPER.provide("Llama", Llama)            # nn.Llama and nn.KVCache (nn sits below this package)
_NN_UPPER.provide("KVCache", KVCache)

__all__ = ["Llama", "KVCache", "generate", "sample", "LlamaConfig", "TPShard", "CheckpointReader", "rope_inv_freq"]


def _models():
    from .. import models
    return models


# moved to tessera_rt.models (issue 41: training code does not live here), kept for one release
__getattr__ = _aliases(__name__, {"LlamaLM": ("tessera_rt.models.LlamaLM", lambda: _models().LlamaLM),
                                  "export_hf": ("tessera_rt.models.export_hf", lambda: _models().export_hf)})
