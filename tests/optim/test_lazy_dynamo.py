"""scaleout.optim.lazy_dynamo: building and stepping scaleout's optimizers leaves torch._dynamo
unimported (~2.5 s of CPU per rank at start), and once dynamo is imported the four methods are
still never traced (torch's own guard, as without scaleout). Each case in a fresh interpreter:
the pytest process may have imported dynamo already."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = r"""
import sys, torch
import scaleout.optim as o
from scaleout.optim.lazy_dynamo import GUARDED, defer_dynamo_import

m = torch.nn.Linear(4, 4)
# torch's own optimizers import dynamo in every step (torch.optim.optimizer's
# _use_grad_for_differentiable); scaleout's do not
for opt in (o.LAMB(m.parameters(), lr=1e-3), o.LARS(m.parameters(), lr=0.1)):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
assert "torch._dynamo" not in sys.modules, "an optimizer imported torch._dynamo"
assert defer_dynamo_import() == list(GUARDED)  # idempotent, all four held

graphs = []
def backend(gm, _inputs):
    graphs.append(sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
    return gm

@torch.compile(backend=backend)
def f(x):
    # traced, this would fail on fake tensors (Parameter == Parameter of another shape): it must
    # run eagerly, between two graphs
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))]})
    return x * 2

x = torch.ones(3)
assert torch.equal(f(x), x * 2) and len(opt.param_groups) == 2
assert len(graphs) == 2 and not any("add_param_group" in t for g in graphs for t in g), graphs
print("ok")
"""


def test_optimizers_leave_dynamo_unimported_and_guarded_once_it_is() -> None:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    said = r.stdout[-2000:] + r.stderr[-3000:]
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), said


BUILD = r"""
import sys, torch
from scaleout.config.schema import OptimConfig
from scaleout.optim import build_optimizer

name = sys.argv[1]
build_optimizer(torch.nn.Linear(4, 4), OptimConfig(name=name, lr=0.1))
print("loaded" if "torch._dynamo" in sys.modules else "not loaded")
"""


@pytest.mark.parametrize("name, want", [("lamb", "not loaded"), ("lars", "not loaded"),
                                        ("adamw", "loaded"), ("sgd", "loaded")])  # fmt: skip
def test_torch_optimizers_import_dynamo_when_built_not_in_the_first_timed_step(
    name: str, want: str
) -> None:
    """torch's AdamW and SGD import dynamo in their first step(), inside MLPerf's clock: the
    factory imports it while building them (before run_start); scaleout's LAMB and LARS never
    need it."""
    r = subprocess.run(
        [sys.executable, "-c", BUILD, name], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == want, r.stdout[-2000:] + r.stderr[-3000:]
