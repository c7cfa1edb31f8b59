"""Stochastic backpropagation: exactness against e2e, gradient spec, BN policy, memory, state."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from videotrain.config.build import CONFIG_DIR
from videotrain.memory import EndToEnd, StochasticBackprop, encode_all_frames
from videotrain.memory.sampling import keep_mask

CONFIGS = Path(CONFIG_DIR)
TIMM = ["timm_resnet", "timm_convnext", "timm_vit"]  # tiny timm models (tests/memory/conftest.py)
BACKBONES = ["resnet", "vit", *TIMM]


def sbp(**kw) -> StochasticBackprop:
    return StochasticBackprop(**{"keep_ratio": 0.5, "seed": 0, "rank": 0, **kw})


def backbone_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.backbone.named_buffers()}


@pytest.mark.parametrize("backbone", BACKBONES)
def test_keep_ratio_one_reproduces_e2e_exactly(kit, backbone: str) -> None:
    ref, model = kit.model_pair(backbone, sbp(keep_ratio=1.0))
    x = kit.video()
    assert torch.equal(kit.step(ref, x), kit.step(model, x))
    kit.assert_close_dicts(kit.grads(ref), kit.grads(model), rtol=0, atol=0)
    for (n, a), b in zip(kit.bn_buffers(ref).items(), kit.bn_buffers(model).values(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("backbone", BACKBONES)
def test_forward_and_running_stats_equal_e2e(kit, backbone) -> None:
    ref, model = kit.model_pair(backbone, sbp(keep_ratio=0.25))
    x = kit.video()
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    ours, theirs = backbone_buffers(model), backbone_buffers(ref)
    for n in theirs:
        if n.endswith("num_batches_tracked"):
            assert int(ours[n]) == int(theirs[n]) == 1, n  # updated exactly once
        else:  # e2e's kernel over all frames, up to rounding: lockstep reduces the rows in
            # [kept | dropped] order, its kept/dropped convolutions round with their batch size
            # (timm resnet10t's 1x1 downsample conv on 2x2 maps: ~1e-7)
            torch.testing.assert_close(ours[n], theirs[n], rtol=1e-5, atol=1e-6, msg=n)


def _hand_reference(kit, backbone: str, policy: str, keep: torch.Tensor, x: torch.Tensor,
                    dtype: torch.dtype = torch.float32):
    """e2e with the dropped frames held constant: their features detached before the head
    and (with full-batch BN) their rows detached at every BN input, in ``dtype``. Returns the
    model and its logits."""
    ref, _ = kit.model_pair(backbone, EndToEnd())
    ref.to(dtype)
    mask = keep_mask(keep, kit.T)  # (B, T)
    hooks = kit.detach_bn_inputs(ref.backbone, mask.flatten()) if policy == "full_batch" else []
    if policy == "frozen":
        for m in ref.backbone.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    b, t = x.shape[:2]
    feats = ref.backbone(x.flatten(0, 1)).view(b, t, -1)  # (B, T, D)
    feats = torch.where(mask[..., None], feats, feats.detach())
    logits = ref.head(feats, torch.arange(t).expand(b, t))
    nn.functional.cross_entropy(logits, kit.labels()).backward()
    for h in hooks:
        h.remove()
    return ref, logits.detach()


@pytest.mark.parametrize(("backbone", "policy"), [("resnet", "full_batch"), ("resnet", "frozen"), ("vit", "full_batch"),
                                                  *((b, "full_batch") for b in TIMM), ("timm_resnet", "frozen")])
def test_gradient_spec(kit, backbone: str, policy: str) -> None:
    strategy = sbp(keep_ratio=0.375, bn_policy=policy, nograd_chunk=3)
    plain, model = kit.model_pair(backbone, strategy)
    x = kit.video(requires_grad=True)
    logits = kit.step(model, x)
    keep = strategy.last_keep  # (B, n)
    assert keep.shape == (kit.B, 3)

    ref, ref_logits = _hand_reference(kit, backbone, policy, keep, x.detach())
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    ours, theirs = kit.grads(model.backbone), kit.grads(ref.backbone)
    kit.assert_close_dicts(ours, theirs, rtol=1e-4, atol=1e-6)
    # the head sees e2e's features, so its gradients are e2e's
    kit.assert_close_dicts(kit.grads(model.head), kit.grads(ref.head), rtol=1e-4, atol=1e-6)
    if policy == "full_batch":
        # plain e2e: same head gradients, but different backbone gradients (the spec has teeth)
        kit.step(plain, x.detach())
        kit.assert_close_dicts(kit.grads(model.head), kit.grads(plain.head), rtol=1e-4, atol=1e-6)
        assert any(not torch.allclose(ours[n], g, atol=1e-5) for n, g in kit.grads(plain.backbone).items())

    per_frame = x.grad.abs().flatten(2).sum(2)  # (B, T)
    mask = keep_mask(keep, kit.T)
    assert bool((per_frame[~mask] == 0).all()), "dropped frames must get exactly zero gradient"
    assert bool((per_frame[mask] > 0).all())


@pytest.mark.parametrize("record_apply", [False, True], ids=["lockstep", "record_apply"])
def test_full_batch_bn_on_a_float64_model_matches_the_float64_reference(kit, record_apply: bool) -> None:
    """``bn_policy=full_batch`` on a float64 model: the backward used to crash (fp32 statistics
    handed to the fp64 BN backward kernel). Now the statistics and the backward arithmetic are
    fp64, so the gradients meet the hand reference at fp64 precision (fp32 arithmetic anywhere
    in the BN backward would miss 1e-9 by orders of magnitude), in both implementations."""
    torch.manual_seed(0)
    kw = {"keep_ratio": 0.375, "nograd_chunk": 3, "seed": 0, "rank": 0}
    strategy = kit.RecordApply(**kw) if record_apply else sbp(**kw)
    _, model = kit.model_pair("resnet", strategy)
    model.double()
    x = kit.video().double()
    logits = model(x)
    nn.functional.cross_entropy(logits, kit.labels()).backward()
    assert logits.dtype == torch.float64
    ref, ref_logits = _hand_reference(kit, "resnet", "full_batch", strategy.last_keep, x,
                                      dtype=torch.float64)
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-10, atol=1e-12)
    ours, theirs = kit.grads(model.backbone), kit.grads(ref.backbone)
    assert all(g.dtype == torch.float64 for g in ours.values())
    kit.assert_close_dicts(ours, theirs, rtol=1e-9, atol=1e-12)


def test_full_batch_bn_backward_meets_the_cuda_kernels_contract(kit, monkeypatch) -> None:
    """CUDA's BN backward asserts that the saved statistics are given, in eval mode too (CPU
    reads the running pair there and ignores them): SBP's BN backward passed none and failed
    on every GPU ("save_mean should always be defined", found by the first GPU run,
    docs/results/gpu/). The CPU twin of that precondition: each call hands a defined (mean,
    invstd) pair. The one kept-rows BN backward (``KeptRowsBatchNorm``) calls the kernel in
    training mode with the full batch's statistics, as autograd's own BN backward does
    (``mean``/``var`` unused there), under the lockstep code and record/apply alike, once per
    BN layer. The gpu-marked tests run the kernel itself."""
    real = torch.ops.aten.native_batch_norm_backward
    calls = []

    def checked(grad, x, w, mean, var, save_mean, save_invstd, train, eps, mask):
        assert save_mean is not None and save_invstd is not None
        assert save_mean.shape == save_invstd.shape == (x.shape[1],)
        calls.append(train)
        return real(grad, x, w, mean, var, save_mean, save_invstd, train, eps, mask)

    monkeypatch.setattr(torch.ops.aten, "native_batch_norm_backward", checked)
    for strategy in (sbp(), kit.RecordApply(keep_ratio=0.5, seed=0, rank=0)):
        _, model = kit.model_pair("resnet", strategy)
        calls.clear()
        kit.step(model, kit.video())
        n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.backbone.modules())
        assert calls == [True] * n_bn, (type(strategy).__name__, calls)


def test_grad_scale_inverse_keep_scales_backbone_grads_only(kit) -> None:
    _, plain = kit.model_pair("vit", sbp(keep_ratio=0.25))
    _, scaled = kit.model_pair("vit", sbp(keep_ratio=0.25, grad_scale="inverse_keep"))
    x = kit.video()
    assert torch.equal(kit.step(plain, x), kit.step(scaled, x))  # forward unchanged
    factor = {n: g * 4.0 for n, g in kit.grads(plain.backbone).items()}  # T / n = 8 / 2
    kit.assert_close_dicts(kit.grads(scaled.backbone), factor, rtol=1e-5, atol=1e-6)
    kit.assert_close_dicts(kit.grads(scaled.head), kit.grads(plain.head), rtol=0, atol=0)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_saved_activation_bytes_scale_with_keep_ratio(kit, backbone: str) -> None:
    x = kit.video()
    sizes = {}
    for r in (0.25, 0.5, 0.75, 1.0):
        strategy = sbp(keep_ratio=r)
        bb = strategy.prepare(kit.BACKBONES[backbone]().train())
        sizes[r] = kit.saved_bytes(lambda bb=bb, s=strategy: s.encode(bb, x), exclude=bb)
    e2e_bb = kit.BACKBONES[backbone]().train()
    assert sizes[1.0] == kit.saved_bytes(lambda: encode_all_frames(e2e_bb, x), exclude=e2e_bb)
    assert sizes[0.25] < sizes[0.5] < sizes[0.75], sizes
    for r in (0.25, 0.5, 0.75):
        assert abs(sizes[r] / sizes[1.0] - r) <= 0.1 * r, (r, sizes)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_noop_in_eval_and_under_no_grad(kit, backbone: str) -> None:
    plain = kit.BACKBONES[backbone]()
    strategy = sbp()  # patches every BN layer
    bb = strategy.prepare(copy.deepcopy(plain))
    x = kit.video()
    frames = x.flatten(0, 1)
    with torch.no_grad():
        assert torch.equal(bb.eval()(frames), plain.eval()(frames))
        bb.train(), plain.train()
        out = strategy.encode(bb, x)  # training mode, but no autograd: plain forward
        assert torch.equal(out.features, encode_all_frames(plain, x).features)
    assert strategy.sampler.draws == 0
    kit.assert_close_dicts(kit.bn_buffers(bb), kit.bn_buffers(plain), rtol=0, atol=0)
    # outside encode, patched BN behaves like the original, gradients too
    y, y_ref = bb(frames), plain(frames)
    assert torch.equal(y, y_ref)
    y.square().sum().backward(), y_ref.square().sum().backward()
    kit.assert_close_dicts(kit.grads(bb), kit.grads(plain), rtol=0, atol=0)


def _bf16_grad_error(kit, backbone: str, strategy_factory, x: torch.Tensor) -> float:
    """Relative L2 error of all gradients, bf16 autocast against fp32, same masks."""
    y = kit.labels()[: x.shape[0]]
    _, fp32 = kit.model_pair(backbone, strategy_factory(), head="mean")
    _, bf16 = kit.model_pair(backbone, strategy_factory(), head="mean")
    nn.functional.cross_entropy(fp32(x), y).backward()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = bf16(x)
    assert logits.dtype == torch.bfloat16
    nn.functional.cross_entropy(logits.float(), y).backward()
    ref = torch.cat([g.flatten() for g in kit.grads(fp32).values()])
    got = torch.cat([g.flatten().float() for g in kit.grads(bf16).values()])
    return float((got - ref).norm() / ref.norm())


@pytest.mark.parametrize("backbone", ["resnet", "vit"])
def test_bf16_autocast_runs_and_matches_fp32(kit, backbone: str) -> None:
    # CPUs without native bf16 run bf16 convolutions slowly: a (1, 4) clip for the ResNet
    x = kit.video()[:1, :4] if backbone == "resnet" else kit.video()
    err = _bf16_grad_error(kit, backbone, sbp, x)
    # loose: bf16 itself moves this tiny model's gradients (a BN ResNet's by ~20% in e2e)
    e2e_err = _bf16_grad_error(kit, backbone, EndToEnd, x)
    assert err < max(0.1, 1.5 * e2e_err), (err, e2e_err)


def test_frozen_policy_keeps_running_stats_and_uses_them(kit) -> None:
    ref, model = kit.model_pair("resnet", sbp(bn_policy="frozen"))
    before = backbone_buffers(model)
    x = kit.video()
    logits = kit.step(model, x)
    kit.assert_close_dicts(backbone_buffers(model), before, rtol=0, atol=0)
    for m in ref.backbone.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    torch.testing.assert_close(logits, ref(x).detach(), rtol=1e-5, atol=1e-5)
    assert all(m.training for m in model.backbone.modules()), "modes restored after encode"


def test_state_dict_round_trip_reproduces_next_mask(kit) -> None:
    a = sbp(seed=7)
    _, model = kit.model_pair("vit", a)
    for i in range(2):
        model(kit.video(i))
    state = copy.deepcopy(a.state_dict())
    model(kit.video(2))
    expected = a.last_keep.clone()

    b = sbp(seed=0)  # the checkpoint's seed wins
    _, model_b = kit.model_pair("vit", b)
    b.load_state_dict(state)
    model_b(kit.video(2))
    assert torch.equal(b.last_keep, expected)


def test_describe_and_validation() -> None:
    d = sbp(sampler="uniform").describe()
    assert d["strategy"] == "sbp" and d["keep_ratio"] == 0.5
    assert (d["sampler"], d["bn_policy"], d["grad_scale"], d["nograd_chunk"], d["recompute"]) == (
        "uniform", "full_batch", "none", "auto", None)
    assert sbp(grad_scale="inverse_keep", nograd_chunk=4).describe()["nograd_chunk"] == 4
    for bad in ({"keep_ratio": 0.0}, {"grad_scale": "auto"}, {"grad_scale": "sqrt"},
                {"bn_policy": "split"}, {"nograd_chunk": 0}, {"sampler": "stride"},
                {"recompute_budget_frac": 0.5}):
        with pytest.raises(ValueError):
            sbp(**bad)
    for gone in ({"granularity": "frame"}, {"lockstep": True}, {"blocks": 1.0}, {"checkpoint": "sqrt"}):
        with pytest.raises(TypeError):  # removed in 0.2.0 (no shims): not a setting
            sbp(**gone)


def test_unprepared_backbone_is_an_error(kit) -> None:
    with pytest.raises(RuntimeError, match="prepare"):
        sbp().encode(kit.tiny_resnet().train(), kit.video())


@pytest.mark.parametrize("name", ["sbp", "frame_dropout", "e2e"])
def test_memory_configs_instantiate(name: str) -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=[f"memory={name}", "seed=7"])
    strategy = instantiate(cfg.memory)
    assert strategy.name == name
    if name != "e2e":
        assert strategy.describe()["seed"] == 7  # the mask seed follows the run seed
    assert strategy.describe()["strategy"] == name
    if name != "e2e":
        assert strategy.keep_ratio == 0.5


def test_direct_construction_defaults_to_the_configs_sampler() -> None:
    """``StochasticBackprop()`` built in code draws the frames ``memory=sbp`` draws (and the
    docs name as the default): ``uniform``, not ``random``."""
    from omegaconf import OmegaConf

    configured = OmegaConf.load(CONFIGS / "memory" / "sbp.yaml").sampler
    assert configured == "uniform"
    assert StochasticBackprop().describe()["sampler"] == configured
    # the same masks as the config's strategy, draw for draw
    direct, from_cfg = StochasticBackprop(seed=5, rank=0), StochasticBackprop(sampler=configured, seed=5, rank=0)
    for _ in range(3):
        assert torch.equal(direct.sampler.sample(4, 8, 4), from_cfg.sampler.sample(4, 8, 4))


@pytest.mark.parametrize("exp", ["synthetic_sbp", "kinetics_sbp"])
def test_exp_configs_select_sbp(exp: str) -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=[f"+exp={exp}"])
    assert cfg.memory._target_.endswith("StochasticBackprop")
    assert cfg.memory.keep_ratio == 0.5


def test_prepared_model_deepcopies_and_pickles(kit, tmp_path: Path) -> None:
    """EMA copies and ``torch.save(model)`` keep working: patches are plain picklable objects
    and a copy's patched modules follow the copy's own strategy."""
    _, model = kit.model_pair("resnet", sbp(keep_ratio=0.25))
    x = kit.video()
    twin = copy.deepcopy(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    out = model(x)
    assert torch.equal(twin(x), out)
    torch.testing.assert_close(loaded(x), out)
    assert twin.strategy.sampler.draws == model.strategy.sampler.draws == loaded.strategy.sampler.draws
