"""The names tools outside the package build the GPU suite's rows with, from one module.

``../shared/tools/gpu_estimate/`` (the CPU-side estimate of a GPU step) reads this module
first, so moving a name's home inside videotrain does not break it. Each name is the object
at its home, with that home's signature; nothing here wraps or changes them."""

from videotrain.bench.cli import setting_overrides
from videotrain.bench.suites import GPU_ROWS, GPU_SETTING, merge_overrides, resolve
from videotrain.config.build import build_model, build_precision, compose_cfg
from videotrain.engine.optim import build_optimizer
from videotrain.memory.sampling import FrameSampler
from videotrain.models.video import wants_channels_last

__all__ = ["GPU_ROWS", "GPU_SETTING", "FrameSampler", "build_model", "build_optimizer",
           "build_precision", "compose_cfg", "merge_overrides", "resolve", "setting_overrides",
           "wants_channels_last"]
