"""tessera_rt.pipeline: pipeline parallelism over the ``pp`` mesh axis (seed 000 §2, §3.3,
§5.2; seed 002 §2.7).  ``dist.Pipeline`` is the public name of ``Pipeline``.

* ``stages``: which layers each stage runs; each stage's sub-mesh (dp, tp inside a stage).
* ``schedules``: GPipe, 1F1B and interleaved 1F1B as per-stage action lists; a simulator.
* ``runner``: ``Pipeline.value_and_grad`` (send/recv boundaries on the ``pp`` stream role).
* ``stats``: measured busy/idle time, bubble and peak live activations per stage.
"""
from ..dist import UPPER as _DIST_UPPER
from .runner import ROLE, Pipeline
from .schedules import SCHEDULES, gpipe, interleaved, one_f_one_b, schedule_for, simulate, theory_bubble
from .stages import StagePlan, split_layers, stage_meshes
from .stats import PipelineStats

_DIST_UPPER.provide("Pipeline", Pipeline)        # dist.Pipeline (dist sits below this package)

__all__ = ["Pipeline", "ROLE", "PipelineStats", "StagePlan", "split_layers", "stage_meshes", "SCHEDULES", "gpipe",
           "one_f_one_b", "interleaved", "schedule_for", "simulate", "theory_bubble"]
