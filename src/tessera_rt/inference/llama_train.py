"""Moved (issue 41: training code does not live in inference/): the Llama training model and its
export are ``tessera_rt.models.llama``, serving a run is ``tessera_rt.inference.runs``.  This
path is kept for one release."""
from ..deprecation import moved
from ..models.llama import (  # noqa: F401  (the old names)
    LlamaBlock,
    LlamaLM,
    RopeAttention,
    char_tokenizer_json,
    export_hf,
    hf_state_dict,
    rotate_half_matrix,
)
from .runs import load_run, run_checkpoint  # noqa: F401

moved("tessera_rt.inference.llama_train", "tessera_rt.models.llama (the model, export_hf) and "
      "tessera_rt.inference.runs (load_run, run_checkpoint)")
