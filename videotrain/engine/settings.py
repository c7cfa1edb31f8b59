"""The ``trainer`` group's and the root config's own settings, declared once, their
resume-neutral keys marked (``videotrain.NEUTRAL``).

Its own module so that both the loop (``engine.trainer``) and the resume guard
(``engine.resume``, which derives its math-neutral keys from the marks) import it, neither
importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from videotrain import NEUTRAL
from videotrain.memory.compiled import check_compile

RESUME_MODES = ("auto", "force", "false")


@dataclass
class RunSettings:
    """The root config's own keys (``configs/config.yaml``; ``videotrain.config.schema.RootSchema`` adds
    the groups)."""

    seed: int = 0
    deterministic: bool = False  # torch.use_deterministic_algorithms + no cuDNN autotuning
    device: str = field(default="auto", metadata=NEUTRAL)  # auto | cpu | cuda | cuda:N
    checkpoint: str | None = field(default=None, metadata=NEUTRAL)  # eval/predict/export: the model
    # eval/predict/export: the run's config.yaml (or the checkpoint's) is the base
    run_config: bool = field(default=True, metadata=NEUTRAL)
    video: str | None = None  # python -m videotrain.predict video=FILE|FOLDER


def resume_mode(value: Any) -> str:
    """``trainer.resume`` normalised to one of ``RESUME_MODES`` (YAML ``false`` is a bool,
    ``true`` means ``auto``); a clear error naming the key otherwise."""
    text = str(value).strip().lower()
    text = "auto" if text == "true" else text
    if text not in RESUME_MODES:
        raise ValueError(f"trainer.resume must be one of auto, force, false; got {value!r}")
    return text


@dataclass
class TrainerSettings:
    """The ``trainer`` config group, declared once: its schema is derived from these fields
    (``videotrain.config.schema``), ``configs/trainer/default.yaml`` holds the same defaults (a test
    checks), and fields marked ``NEUTRAL`` may change when a run resumes (``resume.MATH_NEUTRAL``)."""

    max_epochs: int = field(default=8, metadata=NEUTRAL)  # moves the stop (and the cosine's end)
    max_steps: int | None = field(default=None, metadata=NEUTRAL)  # stop earlier when set
    grad_accum: int = 1
    grad_clip: float | None = 1.0  # max grad norm; None: off
    label_smoothing: float = 0.0
    precision: str = "32"  # "32" | bf16 | "16" (read by engine.precision.Precision.from_config)
    log_every_n_steps: int = field(default=10, metadata=NEUTRAL)
    cpu_metered_steps: int | None = field(default=10, metadata=NEUTRAL)  # CPU: meter the first N steps; None: all
    checkpoint_every_n_steps: int | None = field(default=50, metadata=NEUTRAL)  # None: epoch ends only
    val_every_n_epochs: int = field(default=1, metadata=NEUTRAL)
    test_after_fit: bool = field(default=False, metadata=NEUTRAL)  # read by run.train: multi-view eval
    progress: bool = field(default=True, metadata=NEUTRAL)
    sync_bn: bool = False  # DDP on CUDA: SyncBatchNorm (read by build)
    keep_last_k: int | None = field(default=2, metadata=NEUTRAL)  # step-N.ckpt files kept; None: all
    resume: str | bool = field(default="auto", metadata=NEUTRAL)  # auto | force | false: engine.resume
    channels_last: str | bool = "auto"  # auto | true | false (read by build)
    # torch.compile of the backbone or the strategy's code (videotrain.memory.compiled): auto |
    # true | false, auto on CUDA only; the mode null (the compiler's default) or one it names
    compile: str | bool = field(default="auto", metadata=NEUTRAL)
    compile_mode: str | None = field(default=None, metadata=NEUTRAL)
    # not a trainer key: build.trainer_settings passes data.max_bad_fraction (left out of the schema)
    max_bad_fraction: float = 0.1

    def __post_init__(self) -> None:
        self.resume = resume_mode(self.resume)
        check_compile(self.compile, self.compile_mode)
        if self.keep_last_k is not None and (isinstance(self.keep_last_k, bool)
                                             or not isinstance(self.keep_last_k, int)
                                             or self.keep_last_k < 1):
            raise ValueError(f"trainer.keep_last_k must be an integer >= 1 or null (keep all), "
                             f"got {self.keep_last_k!r}")
        if self.grad_accum < 1:
            raise ValueError(f"trainer.grad_accum must be >= 1, got {self.grad_accum}")
        if self.max_epochs < 1:
            raise ValueError(f"trainer.max_epochs must be >= 1, got {self.max_epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"trainer.max_steps must be >= 1 or null, got {self.max_steps}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"trainer.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.cpu_metered_steps is not None and self.cpu_metered_steps < 2:
            raise ValueError("trainer.cpu_metered_steps must be >= 2 (step 1 allocates gradients and "
                             f"optimizer state) or null, got {self.cpu_metered_steps}")
