"""The project's environment, as a user's python runs it: transformers' VLM classes and timm import in a fresh
interpreter of this environment (``sys.executable``), without tests/conftest.py's torchvision stub. Where the
torchvision wheel's compiled operators do not load with this torch, src/vitrim/torchvision_without_ops.py (put into
the environment by the Makefile, and into vLLM's by vitrim.vllm.cpu_companions) is what makes that true; its finder is
checked here on both branches, and its ``install`` into a site-packages folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FIX = Path(__file__).resolve().parents[2] / "src" / "vitrim" / "torchvision_without_ops.py"


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a new interpreter of this environment (no conftest, no stub: its own imports only)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


def test_transformers_vlm_classes_work_in_a_fresh_interpreter() -> None:
    done = _fresh_python(
        "import transformers\n"
        "config = transformers.LlavaConfig()\n"
        "print(config.model_type, config.text_config.model_type, config.vision_config.model_type)\n"
        "print(transformers.Qwen2VLConfig().model_type)\n"
    )
    assert done.returncode == 0, f"import transformers; transformers.LlavaConfig() failed:\n{done.stderr[-3000:]}"
    assert done.stdout.split() == ["llava", "llama", "clip_vision_model", "qwen2_vl"]


def test_timm_and_torchvision_transforms_work_in_a_fresh_interpreter() -> None:
    done = _fresh_python(
        "import timm, torch, torchvision.transforms as T\n"
        "model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=3)\n"
        "print(tuple(model(torch.zeros(1, 3, 32, 32)).shape), type(T.Resize(8)).__name__)\n"
    )
    assert done.returncode == 0, f"import timm failed:\n{done.stderr[-3000:]}"
    assert done.stdout.strip() == "(1, 3) Resize"


def test_the_finder_answers_only_for_the_registration_modules_and_only_without_operators() -> None:
    """Run in a fresh interpreter on a stand-in ``torchvision.extension``: with operators it answers nothing (a
    matching torchvision imports as shipped), without them empty modules for exactly the two registration modules."""
    done = _fresh_python(
        "import importlib.util, sys, types\n"
        f"spec = importlib.util.spec_from_file_location('fix', {str(FIX)!r})\n"
        "fix = importlib.util.module_from_spec(spec); spec.loader.exec_module(fix)\n"
        "finder = fix.TorchvisionWithoutOps()\n"
        "extension = types.ModuleType('torchvision.extension'); sys.modules['torchvision.extension'] = extension\n"
        "names = ['torchvision._meta_registrations', 'torchvision._autograd_registrations', 'torchvision.ops']\n"
        "for has_ops in (True, False):\n"
        "    extension._has_ops = lambda: has_ops\n"
        "    print(has_ops, [finder.find_spec(n, None) is not None for n in names])\n"
        "spec = finder.find_spec(names[0], None)\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "print(sorted(k for k in vars(module) if not k.startswith('__')))\n"
        "print(sum(isinstance(f, fix.TorchvisionWithoutOps) for f in sys.meta_path))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["True [False, False, False]", "False [True, True, False]", "[]", "1"]


def test_install_puts_the_file_and_its_pth_line_in_a_site_packages_folder(tmp_path: Path) -> None:
    """What the Makefile and vitrim.vllm.cpu_companions run: in a fresh interpreter that reads no site-packages
    (``-S``) but that folder, the .pth line imports the copy there and its finder is on sys.meta_path once."""
    done = subprocess.run(
        [sys.executable, str(FIX), str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torchvision_without_ops.pth", "torchvision_without_ops.py"]
    assert (tmp_path / "torchvision_without_ops.py").read_bytes() == FIX.read_bytes()
    code = (
        f"import site, sys; site.addsitedir({str(tmp_path)!r})\n"
        "print(sys.modules['torchvision_without_ops'].__file__)\n"
        "print(sum(type(f).__name__ == 'TorchvisionWithoutOps' for f in sys.meta_path))\n"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(tmp_path / "torchvision_without_ops.py"), "1"]
