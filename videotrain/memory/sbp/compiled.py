"""SBP under ``trainer.compile``: the lockstep code compiled region by region.

The generated code (``lockstep.py``) alternates per-frame twins, the dropped part's under
``no_grad`` and the kept part's with autograd, with *meets*: calls that see the step's rows or
run an op over both parts beside the kept rows' ``autograd.Function`` (``kept_rows.py``). The
meets stay eager (they hold Python state: the step's ``PartRows``, BN coefficients, in-place
writes into their inputs); every run of twins between two meets is one compiled graph, the
no-grad ones and the grad ones apart (``memory.compiled.split_regions``), so no graph runs a
no-grad pass and a grad pass of the same blocks. The rows reach compiled code only as tensors
and the kept count is fixed per run, so a run compiles once.
"""

from __future__ import annotations

from torch import fx

from videotrain.memory.compiled import Compiler, split_regions
from videotrain.memory.sbp.kept_rows import add_relu_parts, conv_parts
from videotrain.memory.sbp.lockstep import (
    batchnorm_parts,
    dropped_rows,
    join_rows,
    module_parts,
    take_rows,
)

MEETS = {take_rows, dropped_rows, join_rows, batchnorm_parts, conv_parts, add_relu_parts, module_parts}


def is_meet(node: fx.Node) -> bool:
    """A node of the lockstep code that runs eagerly: a meet, or anything reading the rows."""
    if node.op == "call_function" and node.target in MEETS:
        return True
    return any(n.op == "placeholder" and n.name == "rows" for n in node.all_input_nodes)


def compiled_lockstep(twin: fx.GraphModule, compiler: Compiler) -> fx.GraphModule:
    """``twin`` (``lockstep_graph``) with its runs of twins compiled; called the same way."""
    return split_regions(twin, is_meet, compiler)
