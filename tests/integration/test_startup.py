"""What a run's launcher imports before any rank starts: not torch._dynamo (1.4-1.9 s of CPU a
process on a 2-core machine), through the kernels' Dynamo marks or a model built on meta."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.cli import REPO


def test_importing_the_kernels_leaves_dynamo_unloaded():
    code = "import sys, perflab_kernels.triton.device, perflab_kernels.triton.pdl, src.fusion.choice; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_meta_model_has_the_models_parameters_and_leaves_dynamo_unloaded():
    """src/models meta_model: build_model's parameters (names, shapes, dtypes, the tied head) on the
    meta device, with no torch._dynamo import (a fresh process, as the launcher is)."""
    code = ("import sys, torch\nfrom src.config.compose import compose_config\nfrom src.models import build_model, meta_model\n"
            "for name in ('model=tiny', 'model=llama3_tiny', 'model=qwen2_5_0_5b'):\n"
            "    cfg = compose_config([name]).model\n"
            "    m = meta_model(cfg)\n"
            "    assert all(p.is_meta for p in m.parameters())\n"
            "    ref = build_model(cfg) if name != 'model=qwen2_5_0_5b' else None\n"
            "    if ref is not None:\n"
            "        assert [(k, v.shape, v.dtype) for k, v in m.state_dict().items()] == [(k, v.shape, v.dtype) for k, v in ref.state_dict().items()]\n"
            "        assert (m.head.weight is m.embed.weight) == (ref.head.weight is ref.embed.weight)\n"
            "    print(name, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.split() == ["model=tiny", "False", "model=llama3_tiny", "False", "model=qwen2_5_0_5b", "False"], out
