"""torch.fx helpers the strategies share: a backbone's own tracer, and its traced graph made
out of place (in-place ops would overwrite a tensor autograd saved, or one a later segment
reads, once the graph is split or replayed)."""

from __future__ import annotations

import operator

import torch.nn.functional as F
from torch import fx, nn

_INPLACE_FUNCS = {operator.iadd: operator.add, operator.imul: operator.mul, operator.isub: operator.sub}


def make_out_of_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite in-place ops of the traced graph to their out-of-place forms."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.ReLU):
            if gm.get_submodule(str(node.target)).inplace:
                node.op, node.target = "call_function", F.relu
        elif node.op == "call_function" and node.target in _INPLACE_FUNCS:
            node.target = _INPLACE_FUNCS[node.target]
        elif node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).startswith("_"):
            node.target = str(node.target)[:-1]
        if node.op.startswith("call_") and node.kwargs.get("inplace") is True:
            node.kwargs = {**node.kwargs, "inplace": False}
    gm.graph.lint()
    gm.recompile()
    return gm


def symbolic_trace(module: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with the tracer ``module`` asks for (``module.fx_tracer()``,
    the backbone contract's optional hook: timm backbones name their untraceable modules and
    functions), else a plain one."""
    make = getattr(module, "fx_tracer", None)
    tracer = make() if callable(make) else fx.Tracer()
    graph = tracer.trace(module)
    return fx.GraphModule(tracer.root, graph, type(module).__name__)
