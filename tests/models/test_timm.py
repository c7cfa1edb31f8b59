"""``model/backbone=timm``: the backbone contract on real timm models (features, blocks, block
adapters, fx tracing), ViTs at any size, ``model.pretrained`` offline and
``model.pretrained_path`` (safetensors and .pth, timm and torchvision backbones).

Every memory strategy on timm models (a ResNet, a ConvNeXt and a ViT at tiny widths) is tested
with the strategies' own tests, parametrized over those backbones (tests/memory/conftest.py:
``TIMM_TINY``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from omegaconf import open_dict
from safetensors.torch import save_file

from videotrain.config.build import build_model
from videotrain.memory.fx import symbolic_trace
from videotrain.memory.sbp.lockstep import lockstep_graph
from videotrain.models.backbones import PretrainedWeightsUnavailable, resnet
from videotrain.models.temporal_shift import block_adapter
from videotrain.models.timm_backbone import TimmBackbone, find_blocks, timm_backbone
from videotrain.models.weights import PretrainedWeightsMismatch, load_backbone_weights

# name -> (feature dim, blocks, the residual-branch adapter the temporal shift uses, or None: the
# model takes no shift)
REAL = {
    "resnet10t": (512, 4, "timm_resnet_block_forward"),
    "resnet18": (512, 8, "timm_resnet_block_forward"),
    "convnext_atto": (320, 12, None),
    "vit_tiny_patch16_224": (192, 12, None),
}


@pytest.fixture(scope="module")
def real() -> dict[str, TimmBackbone]:
    torch.manual_seed(0)
    return {name: timm_backbone(name) for name in REAL}


@pytest.mark.parametrize("name", list(REAL))
def test_real_models_keep_the_backbone_contract(real, name: str) -> None:
    bb = real[name].train()
    dim, num_blocks, adapter = REAL[name]
    assert bb.feature_dim == dim and len(bb.blocks()) == num_blocks
    if adapter is None:
        with pytest.raises(TypeError, match="ResNet blocks only"):
            block_adapter(bb.blocks()[0])
    else:
        assert {block_adapter(b).__name__ for b in bb.blocks()} == {adapter}
    x = torch.randn(2, 3, 64, 64)  # the default data is 64 px: a 224-px ViT must take it
    assert bb(x).shape == (2, dim)
    # the recompute planner and SBP's lockstep pass trace it with timm's notrace registry
    gm = symbolic_trace(bb)
    torch.testing.assert_close(gm.eval()(x), bb.eval()(x))
    assert lockstep_graph(bb) is not None


def test_vit_takes_any_frame_size(real) -> None:
    vit = real["vit_tiny_patch16_224"].eval()
    for px in (32, 64, 96):
        assert vit(torch.randn(1, 3, px, px)).shape == (1, 192)


def test_blocks_layouts_and_clear_errors() -> None:
    assert find_blocks(torch.nn.Linear(2, 2)) == []
    net = timm_backbone("mobilenetv3_small_050").net  # net.blocks: stages of blocks, flattened
    assert find_blocks(net) == [b for stage in net.blocks for b in stage]
    with pytest.raises(ValueError, match="model.backbone.name='nope_net' is not a timm model"):
        timm_backbone("nope_net")
    with pytest.raises(ValueError, match="kwargs.num_classes"):
        timm_backbone("resnet10t", kwargs={"num_classes": 3})


def test_pretrained_offline_names_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(timm.models._builder, "load_pretrained", offline)
    with pytest.raises(PretrainedWeightsUnavailable) as err:
        timm_backbone("resnet10t", pretrained=True)
    msg = str(err.value)
    assert "model.pretrained=True" in msg and "model.pretrained_path" in msg and "OSError" in msg
    with pytest.raises(ValueError, match="available: resnet10t.c3_in1k"):
        timm_backbone("resnet10t", pretrained="nope")


def _image_model(name: str, path: Path, **kwargs) -> dict[str, torch.Tensor]:
    """A random image model's full state dict (classifier included), saved at ``path``."""
    torch.manual_seed(123)
    net = timm.create_model(name, num_classes=7, **kwargs)
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save({"state_dict": state}, path)  # wrapped, as training scripts save it
    return state


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
@pytest.mark.parametrize(("name", "kwargs"), [
    ("resnet10t", {"channels": (8, 16, 32, 64), "stem_width": 8}),
    ("vit_tiny_patch16_224", {"depth": 1, "embed_dim": 32, "num_heads": 2}),
])
def test_pretrained_path_loads_timm_weights(compose_cfg, tmp_path: Path, name: str, kwargs: dict,
                                            suffix: str) -> None:
    path = tmp_path / f"weights{suffix}"
    saved = _image_model(name, path, **kwargs)
    cfg = compose_cfg(["model/backbone=timm", f"model.backbone.name={name}"])
    with open_dict(cfg):
        cfg.model.backbone.kwargs = kwargs
        cfg.model.pretrained_path = str(path)
    model = build_model(cfg, num_classes=4)
    own = model.backbone.net.state_dict()
    classifier = {k for k in saved if k.split(".")[0] in ("fc", "head")}
    assert classifier and not classifier & set(own)  # the image classifier is dropped
    for k, v in saved.items():
        if k not in classifier:
            assert torch.equal(own[k], v), k


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_pretrained_path_loads_torchvision_weights(tmp_path: Path, suffix: str) -> None:
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(5)
    state = ResNet(BasicBlock, [1, 1, 1, 1]).state_dict()  # with fc
    path = tmp_path / f"tv{suffix}"
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    bb = resnet(layers=[1, 1, 1, 1])
    assert load_backbone_weights(bb, path)["dropped"] == ["fc.bias", "fc.weight"]
    own = bb.net.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items() if not k.startswith("fc."))


def test_pretrained_path_mismatch_and_conflicts(compose_cfg, tmp_path: Path) -> None:
    path = tmp_path / "r18.safetensors"
    _image_model("resnet18", path)
    bb = timm_backbone("resnet10t")
    with pytest.raises(PretrainedWeightsMismatch) as err:
        load_backbone_weights(bb, path)
    msg = str(err.value)
    assert "model.pretrained_path" in msg and "missing keys" in msg and "unexpected keys" in msg
    assert "net.conv1.0.weight" not in msg and "conv1.0.weight" in msg  # named as in the file
    bad = tmp_path / "junk.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read weights"):
        load_backbone_weights(bb, bad)
    with pytest.raises(FileNotFoundError, match="model.pretrained_path"):
        load_backbone_weights(bb, tmp_path / "absent.safetensors")
    cfg = compose_cfg(["model/backbone=timm", "model.backbone.name=resnet10t", "model.pretrained=true"])
    with open_dict(cfg):
        cfg.model.pretrained_path = str(path)
    with pytest.raises(ValueError, match="at most one of model.pretrained"):
        build_model(cfg, num_classes=4)


@pytest.mark.parametrize("name", ["convnext_atto", "vit_tiny_patch16_224"])
def test_config_builds_at_the_default_64_px(compose_cfg, name: str) -> None:
    cfg = compose_cfg(["model/backbone=timm", f"model.backbone.name={name}"])
    assert cfg.data.crop_size == 64
    model = build_model(cfg, num_classes=4).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 2, 3, 64, 64)).shape == (1, 4)


def test_list_kwargs_from_the_config_reach_timm_as_plain_values(compose_cfg) -> None:
    """``+model.backbone.kwargs={dims: [...], depths: [...]}``: lists from the config arrive as
    OmegaConf ListConfigs, which ConvNeXt's ``split_with_sizes`` refused."""
    cfg = compose_cfg(["model/backbone=timm", "model.backbone.name=convnext_atto",
                       "+model.backbone.kwargs={dims: [8, 16, 32, 64], depths: [1, 1, 1, 1]}"])
    model = build_model(cfg, num_classes=4).eval()
    assert model.backbone.feature_dim == 64
    with torch.no_grad():
        assert model(torch.randn(1, 2, 3, 64, 64)).shape == (1, 4)
