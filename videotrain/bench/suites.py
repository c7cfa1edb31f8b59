"""Benchmark suites: named lists of row specs.

A row spec says what the table reports about a configuration (backbone, strategy, keep ratio,
policy, ...) and carries the Hydra overrides that build it. Adding a suite is
adding a list of ``row(...)`` calls to ``SUITES``; every option passed to ``row`` becomes a
``trainer.<key>=<value>`` override when it is named ``trainer_<key>``, else a
``memory.<key>=<value>`` override and a column of the row.

The compile axis: a row runs eager (``trainer.compile=false``, whatever the device) unless it is
the compiled twin of a row (:func:`compiled`: ``trainer.compile=true``, named ``...-compiled``);
``--compile both`` runs every row both ways, the ratios against the eager e2e row.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

R18, R50, VIT, VIT_B16 = "resnet18", "resnet50", "vit_tiny", "vit_b_16"
# A row's strategy -> the word its row name starts with, where they differ: the recomputation
# rows keep the names they were measured under (resnet50/checkpoint-optimal-b0.5, the names GPU
# results are compared by across leases), though memory=recompute builds them
NAME_OF = {"recompute": "checkpoint"}
# timm models are backbones "timm:NAME": model/backbone=timm model.backbone.name=NAME
TIMM_PREFIX = "timm:"
CONVNEXT, TIMM_VIT = f"{TIMM_PREFIX}convnext_atto", f"{TIMM_PREFIX}vit_tiny_patch16_224"

# Fields every row carries, whatever its strategy (None where they do not apply).
ROW_FIELDS = ("backbone", "strategy", "keep_ratio", "granularity", "policy", "compiled")

# Row-spec keys that are not Hydra overrides but instructions to the child (bench/child.py) or
# the runner (bench/cli.py); they tell rows apart like overrides do.
#   compile_budget:     torch.compile the backbone with this min-cut activation_memory_budget
#   peer:               a peer that a suite beside the package applies in its own child
#                       (run_bench(child=...); benchmarks/sac_milp.py: torch's sac_milp plan)
#   auto_budget_of_e2e: memory=auto with memory.budget_mb = this x the e2e row's measured peak
CHILD_KEYS = ("compile_budget", "peer", "auto_budget_of_e2e")
COMPILE_AXIS = ("eager", "compiled", "both")  # --compile


@dataclass(frozen=True)
class Setting:
    """What a suite runs at unless the command line says otherwise: model input, device, the
    overrides under every row, the per-row timeout, the wall-clock budget of the whole run
    (rows that would start after it are recorded as not run), and where results go by default.
    ``needs_cuda``: the suite refuses to start without a CUDA device (``CudaRequired``)."""

    batch_size: int = 2
    frames: int = 16
    size: int = 112
    device: str = "auto"
    overrides: tuple[str, ...] = ()
    timeout: float = 1800.0
    time_budget: float | None = None
    needs_cuda: bool = False
    results_root: str | None = None  # default --out: <results_root>/<gpu name slug>/


def row(
    backbone: str,
    strategy: str,
    keep_ratio: float | None = None,
    policy: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """A row spec. ``keep_ratio=None`` means "no such option" and is reported as 1.0 (every
    frame gets a backward), so e2e and recompute rows sit at keep ratio 1 in the plots."""
    trainer = {k[len("trainer_"):]: options.pop(k) for k in list(options) if k.startswith("trainer_")}
    memory = {"keep_ratio": keep_ratio, "policy": policy, **options}
    overrides = [*backbone_overrides(backbone), f"memory={strategy}"]
    overrides += [f"memory.{k}={v}" for k, v in memory.items() if v is not None]
    overrides += [f"trainer.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in trainer.items()]
    return {
        "backbone": backbone,
        "strategy": strategy,
        "keep_ratio": 1.0 if keep_ratio is None else float(keep_ratio),
        "granularity": granularity_of(strategy),
        "policy": policy,
        **options,
        "overrides": overrides,
    }


def compiled(spec: dict[str, Any], mode: str | None = None) -> dict[str, Any]:
    """``spec``'s twin on the compile axis: ``trainer.compile=true`` (and ``compile_mode``)."""
    extra = ["trainer.compile=true", *([f"trainer.compile_mode={mode}"] if mode else [])]
    return {**spec, "overrides": [*spec["overrides"], *extra]}


def on_axis(rows: list[dict[str, Any]], axis: str) -> list[dict[str, Any]]:
    """``rows`` as ``--compile`` asks: as they are (``eager``), each compiled, or each followed
    by its compiled twin (``both``)."""
    if axis not in COMPILE_AXIS:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_AXIS)}, got {axis!r}")
    if axis == "eager":
        return list(rows)
    return [r for spec in rows for r in ((compiled(spec),) if axis == "compiled" else (spec, compiled(spec)))]


def backbone_overrides(backbone: str) -> list[str]:
    """``resnet18`` -> ``model/backbone=resnet18``; ``timm:NAME`` -> ``model/backbone=timm
    model.backbone.name=NAME``."""
    if backbone.startswith(TIMM_PREFIX):
        return ["model/backbone=timm", f"model.backbone.name={backbone[len(TIMM_PREFIX):]}"]
    return [f"model/backbone={backbone}"]


def granularity_of(strategy: str) -> str | None:
    """The ``granularity`` field of a row: ``frame`` for SBP (the word its row names keep,
    ``resnet50/sbp-frame-0.5``: the names results are compared by), else ``None``."""
    return "frame" if strategy == "sbp" else None


def _sbp(backbone: str, ratios: tuple[float, ...]) -> list[dict[str, Any]]:
    return [row(backbone, "sbp", r) for r in ratios]


R18_SBP_ROWS = [row(R18, "e2e"), *_sbp(R18, (1.0, 0.75, 0.5, 0.25))]
VIT_SBP_ROWS = [row(VIT, "e2e"), *_sbp(VIT, (0.5,))]
SBP_ROWS = [*R18_SBP_ROWS, *VIT_SBP_ROWS]

# timm backbones (model/backbone=timm): a ConvNeXt and a ViT, e2e against frame-level SBP and
# the optimal recomputation plan at half the e2e estimate
TIMM_ROWS = [
    r for b in (CONVNEXT, TIMM_VIT) for r in (
        row(b, "e2e"), row(b, "sbp", 0.5),
        row(b, "recompute", policy="optimal", budget_frac=0.5))
]

DEFAULT_ROWS = [
    *R18_SBP_ROWS,
    *(row(R18, "frame_dropout", r) for r in (0.5, 0.25)),
    *VIT_SBP_ROWS,
    *TIMM_ROWS,
]

# Recomputation (design §2), its composition with SBP, and torch.compile's
# min-cut activation budget as a peer (``compile_budget``: not a memory option, the child sets
# ``torch._functorch.config.activation_memory_budget`` and compiles the backbone).
# ``budget="min"``: the optimal plan at the smallest feasible budget; the child reports the
# budget_frac that turned out to be. The peer from torch itself, its sac_milp planner, is the
# lab's: ``python -m benchmarks.sac_milp``, at this suite's setting.
RECOMPUTE_ROWS = [
    row(R18, "e2e"),
    row(R18, "recompute", policy="blocks"),
    row(R18, "recompute", policy="sqrt"),
    *(row(R18, "recompute", policy="optimal", budget_frac=f) for f in (0.7, 0.5)),
    {**row(R18, "recompute", policy="optimal"), "budget": "min"},
    {**row(R18, "e2e"), "policy": "torch.compile", "budget_frac": 0.5, "compile_budget": 0.5},
    *({**row(R18, "sbp", 0.5, recompute=c), "policy": f"checkpoint:{c}"}
      for c in ("blocks", "optimal")),
]

# The GPU acceptance suite (``--suite gpu``, CUDA only): resnet50 + transformer head, B=8 x
# T=16 at 224 px, bf16 (GPU_SETTING). ``auto_budget_of_e2e``: the runner gives memory=auto a
# budget of that fraction of the e2e row's measured peak in the same run (so e2e runs first).
# e2e without channels_last (``trainer.channels_last: auto`` puts a conv backbone in NHWC on
# CUDA): the comparison in one run. ViT-B/16 + transformer head at B=8 x 64 frames: a long
# clip on a transformer, e2e against frame-level SBP and the recomputation plan. The acceptance
# rows (SBP and recomputation against e2e, NHWC against NCHW) come first, so that a run cut
# short by its time budget still has them; the comparison rows (frame dropout, SBP +
# recomputation, memory=auto) follow, then the compiled twins of the acceptance rows, the
# costliest to start (a compile each) and the least known, e2e first.
NCHW_E2E = {**row(R50, "e2e", trainer_channels_last=False), "policy": "nchw"}
FROZEN_SBP = {**row(R50, "sbp", 0.5, bn_policy="frozen"), "policy": "frozen"}
VIT_B16_SHAPE = {"batch_size": 8, "frames": 64}
VIT_B16_JUDGED = [{**r, **VIT_B16_SHAPE} for r in (
    row(VIT_B16, "e2e"), row(VIT_B16, "sbp", 0.5), row(VIT_B16, "sbp", 0.25))]
VIT_B16_RECOMPUTE = {**row(VIT_B16, "recompute", policy="optimal", budget_frac=0.5), **VIT_B16_SHAPE}
GPU_ROWS = [
    row(R50, "e2e"),
    NCHW_E2E,
    row(R50, "sbp", 0.5),
    row(R50, "sbp", 0.25),
    FROZEN_SBP,
    row(R50, "recompute", policy="sqrt"),
    row(R50, "recompute", policy="optimal", budget_frac=0.5),
    *VIT_B16_JUDGED,
    row(R50, "frame_dropout", 0.5),
    {**row(R50, "sbp", 0.5, recompute="optimal"), "policy": "checkpoint:optimal"},
    VIT_B16_RECOMPUTE,
    {**row(R50, "auto"), "budget_frac": 0.5, "auto_budget_of_e2e": 0.5},
    *(compiled(r) for r in (
        row(R50, "e2e"), row(R50, "sbp", 0.5), row(R50, "recompute", policy="optimal", budget_frac=0.5),
        row(R50, "sbp", 0.25), FROZEN_SBP, row(R50, "recompute", policy="sqrt"), *VIT_B16_JUDGED[:2])),
    compiled(row(R50, "e2e"), "reduce-overhead"),  # CUDA graphs: whether they pay
]

SUITES: dict[str, list[dict[str, Any]]] = {
    "default": DEFAULT_ROWS,
    "sbp": SBP_ROWS,
    "recompute": RECOMPUTE_ROWS,
    "gpu": GPU_ROWS,
}
SUITES["all"] = [r for name in ("default", "recompute") for r in SUITES[name]]

# The GPU suite must finish in 10 minutes on one H100: each row gets at most 240 s (a compile
# that does not finish), and no row runs past 570 s of the run (30 s left for the report). The
# rows that cost most and are least known (memory=auto's planning, the compiled rows) come last.
GPU_SETTING = Setting(batch_size=8, frames=16, size=224, device="cuda",
                      overrides=("trainer.precision=bf16",), timeout=240.0, time_budget=570.0,
                      needs_cuda=True, results_root="outputs/bench/gpu")
SETTINGS: dict[str, Setting] = {"gpu": GPU_SETTING}


def setting_for(suite: str) -> Setting:
    """The suite's own setting; the generic bench setting for suites without one."""
    return SETTINGS.get(suite, Setting())


# ---------------------------------------------------------------------- resolving a suite
def override_key(override: str) -> str:
    """``"+memory.keep_ratio=0.5"`` -> ``"memory.keep_ratio"`` (what a later override replaces)."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*groups: list[str]) -> list[str]:
    """Later groups replace earlier overrides of the same key; order of first appearance kept."""
    merged: dict[str, str] = {}
    for group in groups:
        for ov in group:
            merged[override_key(ov)] = ov
    return list(merged.values())


def _value(overrides: list[str], key: str) -> str | None:
    for ov in overrides:
        if override_key(ov) == key and "=" in ov:
            return ov.split("=", 1)[1]
    return None


def backbone_of(overrides: list[str]) -> str | None:
    """The backbone the overrides choose, as ``row`` names it (``timm:NAME`` for timm)."""
    group = _value(overrides, "model/backbone")
    if group == "timm":
        return TIMM_PREFIX + (_value(overrides, "model.backbone.name") or "resnet18")  # timm.yaml's
    return group


def row_name(spec: dict[str, Any]) -> str:
    """``resnet18/sbp-frame-0.5``, ``vit_tiny/e2e``, ``resnet18/checkpoint-optimal-b0.5``. A row
    with its own input shape keeps its name (the shape is a column of the table)."""
    parts = [NAME_OF.get(spec["strategy"], spec["strategy"])]
    if spec.get("granularity"):
        parts.append(spec["granularity"])
    if spec.get("policy"):
        parts.append(spec["policy"])
    if spec["strategy"] not in ("e2e", "recompute", "auto") or spec["keep_ratio"] != 1.0:
        parts.append(f"{spec['keep_ratio']:g}")
    if spec.get("budget") == "min":
        parts.append("bmin")
    elif spec.get("budget_frac") is not None:
        parts.append(f"b{spec['budget_frac']:g}")
    if spec.get("compiled"):
        parts.append("compiled" + (f":{spec['compile_mode']}" if spec.get("compile_mode") else ""))
    return f"{spec['backbone']}/{'-'.join(parts)}"


# A row's own input shape (spec key -> the config key it sets), where it differs from the suite's
SHAPE_KEYS = {"batch_size": "data.batch_size", "frames": "data.num_frames"}


def own_shape(spec: dict[str, Any]) -> dict[str, Any]:
    """A row's own input shape (``batch_size``, ``frames``), overriding the suite's."""
    return {k: spec[k] for k in SHAPE_KEYS if spec.get(k) is not None}


def resolve(rows: list[dict[str, Any]], base: list[str], extra: list[str],
            only: list[str] | None = None) -> list[dict[str, Any]]:
    """Final row specs: ``base`` (the setting), then each row's overrides, then ``extra`` (the
    user's), later winning per key. Reported fields follow the final overrides (so
    ``model/backbone=resnet10`` moves every row to resnet10); rows that became identical are
    merged, ``only`` (globs on the name or the part after the backbone) filters, and an e2e
    reference row is added for every backbone that lacks one, at that backbone's input shape.
    A row's own shape (:func:`own_shape`) sets ``data.*`` after its overrides, so that the
    config (and ``plan --fit``'s estimate) describes the batch the row runs on."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, ...]] = set()
    for spec in rows:
        shape = [f"{SHAPE_KEYS[k]}={v}" for k, v in own_shape(spec).items()]
        ovs = merge_overrides(base, spec["overrides"], shape, extra)
        if _value(ovs, "model/backbone") != "timm":  # a timm row moved to another backbone
            ovs = [o for o in ovs if override_key(o) != "model.backbone.name" or o in extra]
        if (_value(ovs, "model/backbone") or "resnet10") == "resnet10" and \
                _value(ovs, "model.backbone.temporal_shift") is None:
            # per-frame unless the user says otherwise: resnet10's config (alone) turns TSM's
            # shift on, and these suites measure the strategies on a per-frame model
            ovs = [*ovs, "model.backbone.temporal_shift=0"]
        if _value(ovs, "trainer.compile") is None:  # eager unless asked: auto compiles on CUDA
            ovs = [*ovs, "trainer.compile=false"]
        key = (*sorted(ovs), *(f"{k}={spec.get(k)}" for k in CHILD_KEYS))  # not overrides
        if key in seen:
            continue
        seen.add(key)
        spec = {**spec, "overrides": ovs}
        spec["backbone"] = backbone_of(ovs) or spec["backbone"]
        group = _value(ovs, "memory")
        spec["strategy"] = group if group else spec["strategy"]
        spec["granularity"] = granularity_of(spec["strategy"])
        spec["compiled"] = _value(ovs, "trainer.compile") != "false"
        mode = _value(ovs, "trainer.compile_mode")
        spec["compile_mode"] = None if mode in (None, "null") else mode
        for field in ("keep_ratio", "policy"):
            v = _value(ovs, f"memory.{field}")
            if v is not None:
                spec[field] = float(v) if field == "keep_ratio" else v
        spec["name"] = row_name(spec)
        out.append(spec)
    if only:
        out = [s for s in out if any(
            fnmatch.fnmatch(s["name"], pat) or fnmatch.fnmatch(s["name"].split("/", 1)[1], pat)
            for pat in only)]
    for backbone in dict.fromkeys(s["backbone"] for s in out):
        if not any(s["backbone"] == backbone and s["strategy"] == "e2e" and not s.get("policy")
                   and not s["compiled"] for s in out):
            keep = [e for e in extra if not override_key(e).startswith(("memory", "trainer.compile"))]
            first = next(i for i, s in enumerate(out) if s["backbone"] == backbone)
            ref = resolve([{**row(backbone, "e2e"), **own_shape(out[first])}], base, keep)[0]
            out.insert(first, ref)
    return out
