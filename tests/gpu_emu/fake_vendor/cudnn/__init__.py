"""A fake ``cudnn`` (nvidia-cudnn-frontend) for the tests: the graph API tessera_rt's cuDNN
providers use, with NumPy in place of the GPU.

It records what crosses the boundary (``LOG``: graphs built, their tensors' dims, strides
and types, the ``sdpa`` / ``sdpa_backward`` arguments, handles, streams, executions with
their pointers) and computes what cuDNN documents, independently of tessera_rt's own code:
softmax attention in float64 from the values at the given pointers, rounded to the output
type; ``Stats`` is the natural-log logsumexp of the scaled scores, ``(B, H, Sq, 1)`` f32;
``attn_scale`` defaults to 1 as cuDNN's does; masks follow ``diagonal_alignment`` and
``diagonal_band_right_bound``; ragged tensors start at their offset per batch; paged K/V are
gathered through the page tables; the padding mask uses the per-batch sequence lengths.
Everything runs on the stream the handle was last set to (``set_stream``).  ``CONFIG``
sets the backend version and can make ``check_support`` refuse a graph.
"""
from __future__ import annotations

import enum
import itertools

import numpy as np

import _fake_device as _device

__version__ = "1.32.0+fake"
LOG: dict = {"graphs": [], "executions": [], "handles": [], "set_stream": []}
CONFIG: dict = {"version": 91300, "refuse": None}     # refuse: callable(graph) -> reason or None


def reset() -> None:
    for v in LOG.values():
        v.clear()
    CONFIG.update(version=91300, refuse=None)


class data_type(enum.Enum):
    NOT_SET = 0
    FLOAT = 1
    HALF = 2
    BFLOAT16 = 3
    INT32 = 4
    INT64 = 5


class diagonal_alignment(enum.Enum):
    TOP_LEFT = 0
    BOTTOM_RIGHT = 1


class heur_mode(enum.Enum):
    A = 0
    B = 1
    FALLBACK = 2


class cudnnGraphNotSupportedError(RuntimeError):
    pass


def _np_type(t: data_type) -> np.dtype:
    import ml_dtypes
    return {data_type.FLOAT: np.dtype(np.float32), data_type.HALF: np.dtype(np.float16),
            data_type.BFLOAT16: np.dtype(ml_dtypes.bfloat16), data_type.INT32: np.dtype(np.int32),
            data_type.INT64: np.dtype(np.int64)}[t]


def backend_version() -> int:
    return CONFIG["version"]


_HANDLES = itertools.count(0x1000)
_STREAM_OF: dict = {}


def create_handle() -> int:
    h = next(_HANDLES)
    LOG["handles"].append(h)
    _STREAM_OF[h] = 0
    return h


def set_stream(*, handle: int, stream: int) -> None:
    if handle not in _STREAM_OF:
        raise ValueError(f"set_stream: unknown handle {handle:#x}")
    _STREAM_OF[handle] = int(stream)
    LOG["set_stream"].append((handle, int(stream)))


_UIDS = itertools.count(1)


class tensor:
    def __init__(self, name: str, dim=None, stride=None, data_type_=data_type.NOT_SET, virtual: bool = True):
        self.name, self.uid = name, next(_UIDS)
        self.dim = list(dim) if dim is not None else None
        self.stride = list(stride) if stride is not None else None
        self.data_type = data_type_
        self.virtual = virtual
        self.ragged = None

    def set_output(self, flag: bool) -> tensor:
        self.virtual = not flag
        return self

    def set_dim(self, dim) -> tensor:
        self.dim = [int(d) for d in dim]
        return self

    def set_stride(self, stride) -> tensor:
        self.stride = [int(s) for s in stride]
        return self

    def set_data_type(self, t) -> tensor:
        self.data_type = t
        return self

    def set_ragged_offset(self, off: tensor) -> tensor:
        self.ragged = off
        return self

    def get_uid(self) -> int:
        return self.uid

    def __repr__(self) -> str:
        return f"<fake cudnn tensor {self.name} dim={self.dim} stride={self.stride} {self.data_type.name}>"


_SDPA_KW = {"generate_stats", "is_inference", "attn_scale", "use_causal_mask", "use_causal_mask_bottom_right",
            "diagonal_alignment", "diagonal_band_right_bound", "diagonal_band_left_bound", "use_padding_mask",
            "seq_len_q", "seq_len_kv", "paged_attention_k_table", "paged_attention_v_table",
            "paged_attention_max_seq_len_kv", "name", "compute_data_type"}
_BWD_KW = {"attn_scale", "use_causal_mask", "use_causal_mask_bottom_right", "diagonal_alignment",
           "diagonal_band_right_bound", "use_padding_mask", "seq_len_q", "seq_len_kv", "use_deterministic_algorithm",
           "name", "max_total_seq_len_q", "max_total_seq_len_kv", "compute_data_type"}


class pygraph:
    def __init__(self, name: str = "graph", io_data_type=data_type.NOT_SET, intermediate_data_type=data_type.NOT_SET,
                 compute_data_type=data_type.NOT_SET, handle=None, **kwargs):
        if kwargs:
            raise TypeError(f"pygraph: unexpected arguments {sorted(kwargs)}")
        self.io, self.compute, self.handle = io_data_type, compute_data_type, handle
        self.tensors: list = []
        self.op = None
        self.stage = "defined"
        LOG["graphs"].append(self)

    def tensor(self, dim, stride, data_type=data_type.NOT_SET, is_virtual=False, is_pass_by_value=False,
               ragged_offset=None, name: str = "", **kwargs) -> tensor:
        if len(dim) != len(stride) or not all(isinstance(int(x), int) for x in list(dim) + list(stride)):
            raise ValueError(f"tensor {name}: dim {dim} and stride {stride}")
        t = tensor(name, dim, stride, data_type, virtual=bool(is_virtual))
        if ragged_offset is not None:
            t.ragged = ragged_offset
        self.tensors.append(t)
        return t

    def sdpa(self, q, k, v, **kw):
        unknown = set(kw) - _SDPA_KW
        if unknown:
            raise TypeError(f"sdpa: unexpected arguments {sorted(unknown)}")
        if ("generate_stats" in kw) == ("is_inference" in kw):
            raise RuntimeError("Exactly one of {generate_stats, is_inference} must be set (prefer generate_stats).")
        o = tensor("o", data_type_=self.io)
        stats = tensor("stats", data_type_=data_type.NOT_SET)
        self.tensors += [o, stats]
        self.op = ("sdpa", dict(q=q, k=k, v=v, o=o, stats=stats, **kw))
        return o, stats

    def sdpa_backward(self, q, k, v, o, dO, stats, **kw):
        unknown = set(kw) - _BWD_KW
        if unknown:
            raise TypeError(f"sdpa_backward: unexpected arguments {sorted(unknown)}")
        grads = [tensor(n, data_type_=self.io) for n in ("dQ", "dK", "dV")]
        self.tensors += grads
        self.op = ("sdpa_backward", dict(q=q, k=k, v=v, o=o, dO=dO, stats=stats, dQ=grads[0], dK=grads[1],
                                         dV=grads[2], **kw))
        return tuple(grads)

    # the build steps, in the order cuDNN requires them
    def _step(self, before: str, after: str) -> None:
        if self.stage != before:
            raise RuntimeError(f"fake cudnn: {after} called at stage {self.stage!r}, expected after {before!r}")
        self.stage = after

    def validate(self) -> None:
        if self.op is None:
            raise RuntimeError("validate: the graph has no operation")
        for t in self.io_tensors():
            if t.dim is None or t.stride is None:
                raise RuntimeError(f"validate: {t.name} has no dims/strides")
        self._step("defined", "validated")

    def build_operation_graph(self) -> None:
        self._step("validated", "built")

    def create_execution_plans(self, modes) -> None:
        if not modes or not all(isinstance(m, heur_mode) for m in modes):
            raise TypeError("create_execution_plans takes a list of cudnn.heur_mode")
        self._step("built", "planned")

    def check_support(self) -> None:
        self._step("planned", "supported")
        refuse = CONFIG["refuse"]
        why = refuse(self) if refuse else None
        if why:
            raise cudnnGraphNotSupportedError(why)

    def build_plans(self, *args) -> None:
        self._step("supported", "ready")

    def get_workspace_size(self) -> int:
        return 4096

    def io_tensors(self) -> list:
        return [t for t in self.tensors if not t.virtual]

    def execute(self, variant_pack: dict, workspace: int, handle=None) -> None:
        if self.stage != "ready":
            raise RuntimeError(f"execute before build_plans (stage {self.stage!r})")
        if handle is None or handle not in _STREAM_OF:
            raise ValueError("execute: pass the handle the graph runs on")
        stream = _STREAM_OF[handle]
        ptrs = {t.uid if not isinstance(t, int) else t: int(p) for t, p in variant_pack.items()}
        missing = [t.name for t in self.io_tensors() if t.uid not in ptrs]
        if missing:
            raise ValueError(f"execute: no device pointer for {missing}")
        _device.view(workspace, (self.get_workspace_size(),), (1,), np.uint8, "workspace")
        entry = {"graph": self, "stream": stream, "handle": handle, "ptrs": dict(ptrs), "workspace": int(workspace),
                 "current_stream": _device.current_stream_ptr()}
        LOG["executions"].append(entry)
        kind, args = self.op
        from ._math import run_backward, run_forward
        entry["read"] = (run_forward if kind == "sdpa" else run_backward)(self, args, ptrs, stream)
