"""Renamed ``tessera_rt.inference.hf`` (issue 41: "checkpoint" is ``dist.save``/``dist.load``'s
word; this module reads Hugging Face checkpoints).  This path is kept for one release."""
from ..deprecation import moved
from .hf import CheckpointReader, LlamaConfig, StateDictReader, rope_inv_freq  # noqa: F401  (the old names)

moved("tessera_rt.inference.checkpoint", "tessera_rt.inference.hf")
