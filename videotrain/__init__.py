"""videotrain: memory-efficient training of per-frame video models."""

__version__ = "0.1.0"

# The mark of a config key that may differ between a checkpoint and the run resuming it, put where
# the key is declared, in any layer: ``field(default=..., metadata=NEUTRAL)`` on a dataclass field
# (on a dataclass-typed field: its whole node), ``Annotated[type, NEUTRAL_MARK]`` on a function's
# argument. ``videotrain.engine.checkpoints.resume`` collects them (``MATH_NEUTRAL``).
NEUTRAL_MARK = "math_neutral"
NEUTRAL = {NEUTRAL_MARK: True}
