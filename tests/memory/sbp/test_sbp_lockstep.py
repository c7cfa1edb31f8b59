"""Lockstep SBP (``sbp/lockstep.py``): the twin code generated once per backbone gives the values,
statistics and gradients of record/apply (``sbp/split.py``, called directly, or through the
``RecordApply`` strategy of tests/memory/conftest.py) and stores no more, with every frame's
convolutions run once; memory formats kept; record/apply, logged with its reason, when a
backbone cannot be traced or the kept path is recomputed; grad mode restored after an error.

The SBP specification itself (gradient spec, forward = e2e, ratios) is tested in
``test_sbp.py``, where lockstep is the default path for the BN ResNet."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import fx, nn

from videotrain.memory import StochasticBackprop
from videotrain.memory.sbp import strategy as sbp_strategy
from videotrain.memory.sbp.lockstep import PartRows, lockstep_forward, lockstep_graph
from videotrain.memory.sbp.split import FullBatchNorm, split_forward
from videotrain.models.backbones import resnet
from videotrain.models.heads import TConvHead
from videotrain.models.video import VideoClassifier


def sbp(**kw) -> StochasticBackprop:
    return StochasticBackprop(**{"keep_ratio": 0.375, "seed": 0, "rank": 0, **kw})


class OddNet(nn.Module):
    """A BN net whose graph has every node kind the interpreter handles: modules, functions,
    methods, a parameter read (get_attr), a tuple argument and a value used twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6, momentum=None)  # cumulative average: its own bookkeeping
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 6).view(6, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, 12)
        y = torch.relu(self.bn(self.conv(x))) * self.gain  # (N, 6, H, W)
        z = self.bn2(self.conv2(y)) + y  # y used twice: its dropped rows must survive bn2
        pooled = z.mean(dim=(2, 3))  # (N, 6), call_method
        return torch.cat((pooled, pooled.square()), dim=1)  # tuple of split values


class Untraceable(OddNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
            x = x * 2
        return super().forward(x)


def _rows(n: int = 8, keep: tuple[int, ...] = (1, 4, 6)) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[list(keep)] = True
    return mask.nonzero().flatten(), (~mask).nonzero().flatten()


def _run(net: nn.Module, x: torch.Tensor, lockstep: bool) -> tuple[torch.Tensor, dict, dict]:
    norm = FullBatchNorm()
    norm.patch(net)
    keep, drop = _rows(x.shape[0])
    if lockstep:
        twin = lockstep_graph(net)
        assert isinstance(twin, fx.GraphModule)
        out = lockstep_forward(twin, x, PartRows(keep, drop))
    else:
        out = split_forward(net, x, keep, drop, norm, needs_stats=True, chunk=2)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    return out.detach(), grads, {n: b.clone() for n, b in net.named_buffers()}


class PlainBNNet(OddNet):
    """BN layers without affine parameters and without running statistics."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm2d(6, affine=False)
        self.bn2 = nn.BatchNorm2d(6, track_running_stats=False)


class TwinConvNet(OddNet):
    """Convolutions into a BN that run once per part (no ``KeptRowsConv``): a padding mode of
    its own, and a convolution whose output the BN does not read alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1, padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, 12)
        c = self.conv2(torch.relu(self.bn(self.conv(x))) * self.gain)
        z = self.bn2(c) + c  # c read twice
        pooled = z.mean(dim=(2, 3))
        return torch.cat((pooled, pooled.square()), dim=1)


class FullRowNet(nn.Module):
    """Every op the lockstep code runs on all rows: convolutions into BNs, a ReLU module, a max
    pool, an identity module, and a residual add with its ReLU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.act, self.pool, self.skip = nn.ReLU(), nn.MaxPool2d(2), nn.Identity()
        self.conv2, self.bn2 = nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.conv3, self.bn3 = nn.Conv2d(6, 6, 1, groups=2), nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, 6)
        y = self.pool(self.act(self.bn(self.stem(x))))  # (N, 6, H/2, W/2)
        z = self.act(self.skip(self.bn2(self.conv2(y))))
        return torch.relu(self.bn3(self.conv3(z)) + y).mean(dim=(2, 3))


@pytest.mark.parametrize("net_cls", [OddNet, PlainBNNet, TwinConvNet, FullRowNet],
                         ids=["every-node-kind", "plain-bn", "twin-convs", "full-rows"])
def test_lockstep_matches_record_apply(kit, net_cls) -> None:
    """Every node kind, BN layers without affine parameters or running statistics,
    convolutions that run once per part, and every op that runs on all rows: the generated code
    gives record/apply's values, gradients and buffers."""
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()
    got = _run(net_cls().train(), x, lockstep=True)
    x_grad, x.grad = x.grad.clone(), None
    want = _run(net_cls().train(), x, lockstep=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    kit.assert_close_dicts(got[1], want[1], rtol=1e-4, atol=1e-6)
    kit.assert_close_dicts(got[2], want[2], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x_grad, x.grad, rtol=1e-4, atol=1e-6)
    keep, drop = _rows()
    assert x_grad[drop].abs().sum() == 0 and x_grad[keep].abs().sum() > 0
    if net_cls is OddNet:
        assert int(got[2]["bn.num_batches_tracked"]) == int(got[2]["bn2.num_batches_tracked"]) == 1
    if net_cls is FullRowNet:
        code = lockstep_graph(FullRowNet().train()).code
        assert code.count("conv_parts(") == 2 and code.count("add_relu_parts(") == 1
        assert code.count("join_rows(") == 1  # the stem's parts, at its BN


def test_forward_is_e2e_forward() -> None:
    """Every BN's output is the full-batch forward's own rows: the kept rows' values come from
    the same kernel call as the dropped rows', not from a second normalisation (equal to e2e's up
    to the rounding of a reduction over the rows in another order)."""
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    ref = OddNet().train()
    with torch.no_grad():
        want = ref(x)
    got = _run(OddNet().train(), x, lockstep=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backbone", ["resnet", "timm_resnet"])  # timm: traced by its own tracer
def test_model_level_matches_record_apply_and_runs_each_frame_once(kit, backbone: str) -> None:
    x = kit.video()
    out: dict[bool, tuple] = {}
    for lockstep in (True, False):
        strategy = sbp() if lockstep else kit.RecordApply(keep_ratio=0.375, seed=0, rank=0)
        _, model = kit.model_pair(backbone, strategy)
        rows: dict[int, list[int]] = {0: [], 1: []}
        convs = [m for m in model.backbone.modules() if isinstance(m, nn.Conv2d)]  # leaves
        hooks = [convs[i].register_forward_hook(
            lambda _m, args, _o, seen=rows[i]: seen.append(args[0].shape[0])) for i in rows]
        logits = kit.step(model, x)
        for hook in hooks:
            hook.remove()
        out[lockstep] = (logits, kit.grads(model), kit.bn_buffers(model), rows)
    n_rows, n_keep = kit.B * kit.T, kit.B * 3  # 0.375 * 8 = 3 frames per clip
    # the stem, on the input's two parts: dropped (no_grad), kept, once each; the next
    # convolution, into a BN: once over all frames (the kept rows' graph beside it)
    assert out[True][3] == {0: [n_rows - n_keep, n_keep], 1: [n_rows]}
    # record pass over all frames, then kept again
    assert out[False][3] == {0: [n_rows, n_keep], 1: [n_rows, n_keep]}
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    backbone = {k: v for k, v in out[True][1].items() if k.startswith("backbone.")}
    kit.assert_close_dicts(backbone, {k: out[False][1][k] for k in backbone}, rtol=1e-4, atol=1e-6)
    for name, buf in out[True][2].items():
        if name.startswith("backbone."):  # e2e's statistics, up to rounding (row order, and a
            # conv kernel's batch-size-dependent rounding)
            torch.testing.assert_close(buf, out[False][2][name], rtol=1e-5, atol=1e-6)


def test_stores_what_record_apply_stores(kit) -> None:
    x = kit.video()
    sizes = {}
    for lockstep in (True, False):
        strategy = sbp(keep_ratio=0.5) if lockstep else kit.RecordApply(keep_ratio=0.5, seed=0, rank=0)
        bb = strategy.prepare(kit.BACKBONES["resnet"]().train())
        sizes[lockstep] = kit.saved_bytes(lambda bb=bb, s=strategy: s.encode(bb, x), exclude=bb)
    # the same kept-row activations (record/apply also keeps its recorded statistics)
    assert 0.99 * sizes[False] <= sizes[True] <= sizes[False], sizes


def test_untraceable_backbone_falls_back_to_record_apply_saying_why(caplog) -> None:
    net = Untraceable().train()
    with caplog.at_level(logging.INFO, logger="videotrain.memory.sbp"):
        assert lockstep_graph(net) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "record/apply" in said[0] and "Untraceable" in said[0], said
    assert "TraceError" in said[0], said  # the reason: fx's error on the data-dependent branch
    assert lockstep_graph(OddNet()) is not None
    x = torch.randn(8, 3, 6, 6)
    strategy = sbp()
    strategy.prepare(net)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="videotrain.memory.sbp"):
        for _ in range(2):
            out = strategy.encode(net, x.view(2, 4, 3, 6, 6))  # record/apply: still works
    assert out.features.shape == (2, 4, 12) and out.features.requires_grad
    assert len(caplog.records) == 1  # decided, and said, once per backbone


def test_error_mid_pass_restores_grad_mode() -> None:
    class Fails(OddNet):  # raises inside the dropped part's no_grad region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.softmax(self.conv(x), dim=7)

    net = Fails().train()
    twin = lockstep_graph(net)
    assert twin is not None
    keep, drop = _rows()
    with pytest.raises(IndexError):
        lockstep_forward(twin, torch.randn(8, 3, 6, 6), PartRows(keep, drop))
    assert torch.is_grad_enabled()


def test_twin_is_built_once_per_backbone_and_not_pickled(kit, monkeypatch) -> None:
    """No per-step interpretation: the twin module is generated at the first step and reused."""
    built = []
    real = sbp_strategy.lockstep_graph
    monkeypatch.setattr(sbp_strategy, "lockstep_graph", lambda *a, **k: built.append(1) or real(*a, **k))
    strategy = sbp()
    bb = strategy.prepare(kit.BACKBONES["resnet"]().train())
    x = kit.video()
    strategy.encode(bb, x)
    traced = strategy._traced
    strategy.encode(bb, x)
    assert strategy._traced is traced and isinstance(traced[1], fx.GraphModule)
    assert len(built) == 1
    assert "batchnorm_parts" in traced[1].code  # BN meets both parts in the generated code
    assert strategy.__getstate__()["_traced"] is None


def test_composed_with_recomputation_uses_record_apply_saying_why(kit, monkeypatch, caplog) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("the lockstep code ran with memory.recompute")

    monkeypatch.setattr(sbp_strategy, "lockstep_forward", refuse)
    monkeypatch.setattr(sbp_strategy, "lockstep_graph", refuse)
    _, model = kit.model_pair("resnet", sbp(recompute="sqrt"))
    with caplog.at_level(logging.INFO, logger="videotrain.memory.sbp"):
        kit.step(model, kit.video())
        kit.step(model, kit.video())
    said = [r.getMessage() for r in caplog.records if r.name.startswith("videotrain.memory.sbp")]
    assert said == ["memory=sbp: record/apply, since memory.recompute=sqrt recomputes the kept "
                    "path, which the lockstep code does not"], said


def test_nograd_chunks_run_outside_the_lockstep_code_saying_why(kit, monkeypatch, caplog) -> None:
    """``memory.nograd_chunk=N`` where nothing couples the frames (frozen BN, a ViT): the dropped
    frames in pieces of N, which only record/apply's plain scheme runs; with full-batch BN the
    statistics need every frame at once, and the lockstep code runs."""
    calls = []
    real = lockstep_forward
    monkeypatch.setattr(sbp_strategy, "lockstep_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, model = kit.model_pair("resnet", sbp(bn_policy="frozen", nograd_chunk=4))
    with caplog.at_level(logging.INFO, logger="videotrain.memory.sbp"):
        kit.step(model, kit.video())
    assert not calls and ["nograd_chunk" in r.getMessage() for r in caplog.records] == [True]
    _, model = kit.model_pair("resnet", sbp(nograd_chunk=4))
    kit.step(model, kit.video())
    assert calls == [1]


@pytest.mark.parametrize("policy", ["full_batch", "frozen"])
def test_channels_last_gives_the_same_results_and_keeps_the_format(kit, device: torch.device,
                                                                   policy: str) -> None:
    """A channels_last model and input (``trainer.channels_last``): the same logits and gradients
    as the contiguous run, and every conv's input and output stays channels_last (the inputs
    after BN and ReLU, the outputs of both parts)."""
    got = {}
    for fmt in (torch.contiguous_format, torch.channels_last):
        _, model = kit.model_pair("resnet", sbp(bn_policy=policy))
        model.to(device).use_channels_last(fmt == torch.channels_last)
        x = kit.video().to(device).flatten(0, 1).contiguous(memory_format=fmt).view(kit.B, kit.T, 3, kit.PX, kit.PX)
        formats = []

        def record(_m, args, out, formats=formats):
            formats.append(all(t.is_contiguous(memory_format=torch.channels_last) for t in (args[0], out)))

        hooks = [m.register_forward_hook(record) for m in model.backbone.modules()
                 if isinstance(m, nn.Conv2d)]
        logits = model(x)
        nn.functional.cross_entropy(logits, kit.labels().to(device)).backward()
        got[fmt] = (logits.detach(), kit.grads(model), formats)
        for h in hooks:
            h.remove()
    tol = {"rtol": 1e-4, "atol": 1e-5} if device.type == "cpu" else {"rtol": 1e-2, "atol": 1e-3}  # TF32
    torch.testing.assert_close(got[torch.channels_last][0], got[torch.contiguous_format][0], **tol)
    kit.assert_close_dicts(got[torch.channels_last][1], got[torch.contiguous_format][1], **tol)
    formats = got[torch.channels_last][2]
    assert formats and all(formats), formats


def test_module_hooks_see_the_parts() -> None:
    """What docs/memory.md says of forward hooks under frame SBP: a convolution from a BN's
    output into a full-batch BN runs once over all frames, and so does the BN (through its
    training kernel: its module hooks do not fire); a max pool after a BN's ReLU runs on the kept
    rows and then on all rows; any other per-frame module, the stem's convolution included, runs
    once per part, kept rows and dropped rows."""
    torch.manual_seed(0)
    bb = resnet(layers=[1, 1, 1, 1])
    model = VideoClassifier(bb, TConvHead(bb.feature_dim, 4, hidden_dim=16), sbp(keep_ratio=0.25)).train()
    seen: list[tuple[str, int]] = []
    for name, m in (("stem", bb.net.conv1), ("bn", bb.net.bn1), ("pool", bb.net.maxpool),
                    ("conv", bb.net.layer1[0].conv1), ("avgpool", bb.net.avgpool)):
        m.register_forward_hook(lambda m, i, o, name=name: seen.append((name, o.shape[0])))
    model(torch.randn(2, 8, 3, 32, 32)).sum().backward()  # 16 frames, 2 x 2 kept
    assert sorted(seen) == [("avgpool", 4), ("avgpool", 12), ("conv", 16), ("pool", 4), ("pool", 16),
                            ("stem", 4), ("stem", 12)]
