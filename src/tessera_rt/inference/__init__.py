"""tessera_rt.inference: Llama-architecture models from Hugging Face checkpoints, decoded
tensor-parallel through a paged, tp-sharded KV cache with vocab-parallel sampling.

    model = nn.Llama.from_pretrained("dir", mesh=mesh)          # config.json + *.safetensors
    cache = nn.KVCache(model, max_tokens=4096, block_size=16)
    out = model.generate(cache, prompts=[[1, 2, 3]], max_new_tokens=32)
"""
from .checkpoint import CheckpointReader, LlamaConfig, rope_inv_freq
from .generate import generate
from .kv_cache import KVCache
from .llama import Llama, TPShard
from .llama_train import LlamaLM, export_hf
from .sampling import sample

__all__ = ["Llama", "KVCache", "generate", "sample", "LlamaConfig", "TPShard", "CheckpointReader", "rope_inv_freq",
           "LlamaLM", "export_hf"]
