"""Parameter groups: layer-wise LR decay (ViT blocks, CNN stages) and the head's own LR."""

from __future__ import annotations

import pytest
import torch

import videotrain.config.build as builder
from videotrain.engine.optim import backbone_layers, param_groups
from videotrain.models.backbones import resnet, vit
from videotrain.models.heads import MeanHead
from videotrain.models.timm_backbone import timm_backbone
from videotrain.models.video import VideoClassifier


def _lr_of(groups: list[dict]) -> dict[int, float]:
    return {id(p): g["lr"] for g in groups for p in g["params"]}


@pytest.mark.parametrize("backbone,layers,first_block", [
    (lambda: resnet(layers=[2, 1, 1, 1]), 4, "net.layer1.0.conv1.weight"),  # stages
    (lambda: vit(32, 8, 3, 2, 32, 64), 3, "net.encoder.layers.encoder_layer_0.ln_1.weight"),  # blocks
    (lambda: timm_backbone("convnext_atto"), 4, "net.stages.0.blocks.0.conv_dw.weight"),
    (lambda: timm_backbone("vit_tiny_patch16_224", kwargs={"depth": 3}), 3, "net.blocks.0.attn.qkv.weight"),
], ids=["torchvision-resnet", "torchvision-vit", "timm-convnext", "timm-vit"])
def test_layer_ids_follow_stages_or_blocks(backbone, layers: int, first_block: str) -> None:
    ids, n = backbone_layers(backbone())
    assert n == layers and ids[first_block] == 1
    order = list(ids.values())  # in registration (execution) order, ids never go down
    assert order == sorted(order) and order[0] == 0 and set(range(n + 1)) <= set(order) <= set(range(n + 2))


def test_layer_decay_and_head_lr() -> None:
    model = VideoClassifier(resnet(layers=[1, 1, 1, 1]), MeanHead(512, 3))
    groups = param_groups(model, 0.05, lr=1.0, layer_decay=0.5, head_lr=4.0)
    lr = _lr_of(groups)
    net = model.backbone.net
    assert lr[id(net.conv1.weight)] == pytest.approx(0.5 ** 5)  # the stem: layer 0 of 4
    assert lr[id(net.layer1[0].conv1.weight)] == pytest.approx(0.5 ** 4)
    assert lr[id(net.layer4[0].conv1.weight)] == pytest.approx(0.5)
    assert all(lr[id(p)] == 4.0 for p in model.head.parameters())
    assert {g["weight_decay"] for g in groups if g["name"].endswith("no_decay")} == {0.0}
    # without layer decay every backbone parameter trains at lr
    assert {lr for p, lr in _lr_of(param_groups(model, 0.05, lr=1.0)).items()} == {1.0}
    with pytest.raises(ValueError, match=r"optim.layer_decay must be in \(0, 1\]"):
        param_groups(model, 0.05, lr=1.0, layer_decay=1.5)


def test_head_lr_is_scaled_with_the_global_batch(compose_cfg) -> None:
    cfg = compose_cfg(["data.crop_size=32", "optim.lr=0.1", "optim.head_lr=1.0", "optim.lr_scaling=linear",
                       "optim.base_batch_size=4", "data.batch_size=8", "optim.layer_decay=0.75"])
    model = builder.build_model(cfg, 4)
    opt = builder.optimizer_from_cfg(cfg, model)
    lr = _lr_of(opt.param_groups)
    assert sorted({lr[id(p)] for p in model.head.parameters()}) == pytest.approx([2.0])
    assert max(lr[id(p)] for p in model.backbone.parameters()) == pytest.approx(0.2 * 0.75)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # schedules keep the ratios
    assert max(sched.get_last_lr()) == pytest.approx(1.0)
