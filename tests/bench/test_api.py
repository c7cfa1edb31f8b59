"""``videotrain.bench.api``: the names a tool outside the package builds GPU rows with, each the
object at its home (so a tool that reads the module first gets what the package itself runs)."""

from __future__ import annotations

import importlib

import pytest

from videotrain.bench import api

HOMES = {
    "GPU_ROWS": "videotrain.bench.suites", "GPU_SETTING": "videotrain.bench.suites",
    "resolve": "videotrain.bench.suites", "merge_overrides": "videotrain.bench.suites",
    "setting_overrides": "videotrain.bench.cli", "compose_cfg": "videotrain.config.build",
    "build_model": "videotrain.config.build", "build_precision": "videotrain.config.build",
    "build_optimizer": "videotrain.engine.optim", "FrameSampler": "videotrain.memory.sampling",
    "wants_channels_last": "videotrain.models.video",
}


def test_the_api_exports_exactly_the_tools_names() -> None:
    assert sorted(api.__all__) == sorted(HOMES)


@pytest.mark.parametrize("name", sorted(HOMES))
def test_each_name_is_the_object_at_its_home(name: str) -> None:
    assert getattr(api, name) is getattr(importlib.import_module(HOMES[name]), name)


def test_a_gpu_row_resolves_and_composes_through_the_api() -> None:
    """What the estimate tool does first: the suite's rows resolved at the GPU setting, and one
    row's config composed, naming the GPU suite's backbone."""
    s = api.GPU_SETTING
    base = api.setting_overrides(s.batch_size, s.frames, s.size, s.device, s.overrides)
    rows = api.resolve(api.GPU_ROWS, base, [], None)
    assert rows and all("overrides" in r for r in rows)
    cfg = api.compose_cfg(rows[0]["overrides"])
    assert cfg.data.batch_size == s.batch_size and cfg.data.num_frames == s.frames
