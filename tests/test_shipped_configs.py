"""The run files ship inside the wheel, and the notebooks' commands find them by name outside the repository.

08_scale and 09_cli export `colab-t4-qwen-gsm8k` and `tiny-cpu` by name; on Colab there is no repository around the
notebook, only `pip install grpo-lab`. So the wheel is built as a fresh clone builds it, installed alone into a
folder, and the same commands run from an empty folder with that folder as the only grpo_lab on the path.
"""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

SHIPPED = sorted(p.name for p in (ROOT / "grpo_lab" / "configs").glob("*.yaml"))


def test_the_repository_configs_folder_is_the_packaged_one():
    assert {"tiny-cpu.yaml", "colab-t4-qwen-gsm8k.yaml"} <= set(SHIPPED)
    assert (ROOT / "configs").resolve() == (ROOT / "grpo_lab" / "configs").resolve()   # one copy, two paths


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    "(wheel, site folder): the wheel built from the tracked files, installed without dependencies into a folder."
    tmp = tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    clone = tmp / "clone"
    for name in tracked:
        if (ROOT / name).is_file() and not (ROOT / name).is_symlink():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            (clone / name).write_bytes((ROOT / name).read_bytes())
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--quiet", str(clone), "-w", str(tmp / "dist")],
                   check=True, capture_output=True, timeout=300)
    wheel = next((tmp / "dist").glob("grpo_lab-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--quiet", "--target", str(tmp / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return wheel, tmp / "site"


def test_the_wheel_holds_every_run_file(installed_wheel):
    wheel, _ = installed_wheel
    with zipfile.ZipFile(wheel) as z:
        for name in SHIPPED:
            assert z.read(f"grpo_lab/configs/{name}") == (ROOT / "grpo_lab" / "configs" / name).read_bytes()


def run_outside(site: Path, cwd: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"})


def test_the_notebooks_commands_find_the_run_files_outside_the_repository(installed_wheel, tmp_path):
    _, site = installed_wheel
    code = (
        "import grpo_lab, sys\n"
        "from grpo_lab.cli import main\n"
        "from grpo_lab.scale import export_run\n"
        "print(grpo_lab.__file__)\n"
        # 09_cli's cell, then 08_scale's
        "assert main(['export', '--config', 'tiny-cpu', '-o', 'two-gpus', '--gpus', '2']) == 0\n"
        "export_run('colab-t4-qwen-gsm8k', 'qwen-8gpu', num_processes=8, keep_effective_batch=True)\n"
        "sys.exit(main(['train', '--config', 'configs/tiny-cpu.yaml']))\n")   # a repository path: a hint, status 2
    r = run_outside(site, tmp_path, code)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stdout.splitlines()[0].startswith(str(site))                   # the installed wheel, not the checkout
    assert yaml.safe_load((tmp_path / "two-gpus" / "run.yaml").read_text())["model"] == "tiny"
    exported = yaml.safe_load((tmp_path / "qwen-8gpu" / "run.yaml").read_text())
    assert (exported["per_device_train_batch_size"], exported["gradient_accumulation_steps"]) == (4, 1)
    assert "ships a run file of that name: --config tiny-cpu" in r.stderr


def test_config_show_prints_the_shipped_file(installed_wheel, tmp_path):
    _, site = installed_wheel
    r = run_outside(site, tmp_path, "from grpo_lab.cli import main; main(['config', 'show', 'tiny-cpu'])")
    assert r.returncode == 0 and r.stdout == (ROOT / "grpo_lab" / "configs" / "tiny-cpu.yaml").read_text(), r.stderr
