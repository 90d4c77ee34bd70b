"""A train.py ``--arch llama`` run served as an ``nn.Llama``: its checkpoint found in the run
directory, the model rebuilt from the saved flags (``models.llama.LlamaLM``) and its parameters
read with ``dist.load`` through the same per-rank slicing as a Hugging Face checkpoint
(``hf.StateDictReader``).  ``scripts/generate.py --model RUN_DIR`` uses it.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..dist import checkpoint as dck
from ..models.llama import LlamaLM, hf_state_dict
from .hf import LlamaConfig, StateDictReader
from .llama import Llama

__all__ = ["run_checkpoint", "load_run"]


def run_checkpoint(path: str | Path) -> Path | None:
    """The dist.save checkpoint of a train.py run: ``path/checkpoint`` of a run directory, or
    ``path`` itself; None when ``path`` is neither."""
    p = Path(path)
    for ck in (p / "checkpoint", p):
        if (ck / "index.json").is_file():
            return ck
    return None


def load_run(path: str | Path, *, mesh=None, tp_axis: str = "tp", dtype="float32"):
    """The ``nn.Llama`` of a train.py ``--arch llama`` run (``path``: its run directory or its
    checkpoint) and the run's character vocabulary: the model is rebuilt from the saved flags,
    the parameters read with ``dist.load`` (collective) and served through the same per-rank
    slicing as a Hugging Face checkpoint.  Each rank reads the whole parameters first (a
    character model: small)."""
    ck = run_checkpoint(path)
    if ck is None:
        raise ValueError(f"{path} holds no train.py checkpoint ({Path(path) / 'checkpoint' / 'index.json'} does not "
                         "exist)")
    meta = json.loads(dck.read_index(str(ck))["values"]["meta"])
    flags = meta["config"]
    if flags.get("arch") != "llama":
        raise ValueError(f"{ck} is a train.py --arch {flags.get('arch')} run (a character transformer with learned "
                         "positions); generate.py serves the Llama architecture: train with --arch llama")
    chars = list(meta["vocab"])
    model = LlamaLM(len(chars), flags["d_model"], flags["heads"], flags["layers"], flags["seq"],
                    n_kv_heads=flags.get("kv_heads") or None, dtype=flags.get("dtype", "float32"))
    params = dck.load(str(ck), like={"params": model.init(0)})["params"]
    cfg = LlamaConfig.from_dict(model.hf_config(), f"{ck} (the saved flags)")
    reader = StateDictReader(hf_state_dict(model, params), ck)
    return Llama.from_reader(cfg, reader, mesh=mesh, tp_axis=tp_axis, dtype=dtype, where="generate.py"), chars
